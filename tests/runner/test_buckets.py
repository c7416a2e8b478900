"""The step's shape buckets: every shape traffic can need is among those warm-up compiles."""

import pytest

from jaxserve.runner.buckets import StepBuckets


@pytest.mark.parametrize("max_num_seqs", [1, 3, 4, 8, 12, 64])
def test_every_decode_batch_has_a_decode_only_shape(max_num_seqs):
    # Token buckets start at 8 (and 1): a decode step of 2-4 sequences is padded to 8 tokens, past max_seqs = 4.
    b = StepBuckets.choose(256, max_num_seqs, 512, 16, one_token_bucket=True, one_page_bucket=False)
    shapes = set(b.shapes())
    for n in range(1, max_num_seqs + 1):
        tb = min(t for t in b.token_buckets if t >= n)
        for pb in b.page_buckets:
            assert (tb, pb, True) in shapes and (tb, pb, False) in shapes, (n, tb, pb)
    # and no decode-only shape no decode batch can use
    assert max(tb for tb, _, decode in shapes if decode) == min(t for t in b.token_buckets if t >= b.max_seqs)
