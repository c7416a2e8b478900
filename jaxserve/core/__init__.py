"""The host side: requests, sampling parameters, outputs, the block manager, KV events and the scheduler.

Nothing under ``jaxserve.core`` imports jax (tests/core/test_no_jax.py)."""
