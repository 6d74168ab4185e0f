"""Device backends, registered as pluggy plugins (see vllm_hybrid_backends.plugins)."""
