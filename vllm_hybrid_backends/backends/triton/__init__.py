"""Backend package: see backend.py."""
