"""Speculative decoding: n-gram proposals, draft models, and verification."""
