"""Speculative decoding (docs/speculative-decoding.md): drafts proposed per request (n-gram lookup, a draft
engine), verified by the target model in one step (engine.py), accepted where each row's own token equals the draft."""
