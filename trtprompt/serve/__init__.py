"""Serving: Triton model repository, engine process, launcher, Python-backend models."""
