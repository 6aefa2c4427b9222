"""Tiers below the engine's KV pool: a local disk tier and a remote (Redis) tier (docs/prefix-pool.md)."""
