"""Speculative decoding (docs/speculative-decoding.md): drafts proposed per request (n-gram lookup, a draft
engine), verified by the target model in one step (engine.py), accepted exactly (sampler.sample_with_draft)."""
