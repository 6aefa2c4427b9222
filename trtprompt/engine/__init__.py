"""The embedded paged-KV engine. Imports neither Triton nor click."""
