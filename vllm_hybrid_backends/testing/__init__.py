"""Test helpers: a zoo of tiny hybrid models and a runner for the real vLLM engine."""
