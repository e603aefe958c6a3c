"""Speculative decoding with the model's MTP layer: draft, verify in one target forward, accept."""
