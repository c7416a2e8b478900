"""BlockManager: accounting, ref counts, prefix cache hits, LRU eviction, fork and copy-on-write. No jax."""

import pytest
from helpers import SP

from jaxserve.core.block_manager import NULL_PAGE, BlockManager, hash_page
from jaxserve.core.request import Request


def req(rid, tokens):
    return Request(rid, list(tokens), SP(max_tokens=16))


def compute(bm, r, n, cached=()):
    """Allocates and 'runs' n tokens of r: advances num_computed_tokens and commits, like the scheduler."""
    start = len(cached) * bm.page_size if cached else r.num_computed_tokens
    ops = bm.allocate(r, n, cached)
    assert ops is not None
    r.num_computed_tokens = start + n
    bm.commit(r)
    bm.check_invariants()
    return ops


def test_accounting_and_null_page():
    bm = BlockManager(num_pages=9, page_size=4)
    assert bm.num_usable_pages == 8 and bm.num_free_pages == 8 and bm.usage == 0.0
    r = req("a", range(30))  # 30 tokens -> 8 pages: the whole pool
    assert compute(bm, r, 30) == []
    table = bm.page_table("a")
    assert len(table) == 8 and NULL_PAGE not in table and len(set(table)) == 8
    assert bm.num_free_pages == 0 and bm.num_used_pages == 8 and bm.usage == 1.0
    assert all(bm.ref_counts[p] == 1 for p in table)
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_pages == 8 and bm.page_table("a") == []
    bm.free("a")  # freeing twice is a no-op
    assert bm.num_free_pages == 8


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_pages=5, page_size=4, enable_prefix_caching=False)
    a, b = req("a", range(10)), req("b", range(100, 110))
    compute(bm, a, 10)  # 3 pages
    assert bm.allocate(b, 10) is None  # needs 3, 1 free
    bm.check_invariants()
    assert bm.num_free_pages == 1 and bm.page_table("b") == []
    assert bm.allocate(b, 4) == []  # one page fits
    bm.check_invariants()
    assert bm.num_free_pages == 0


def test_decode_grows_table_one_page_at_a_time():
    bm = BlockManager(num_pages=10, page_size=4)
    r = req("a", range(4))
    compute(bm, r, 4)
    assert len(bm.page_table("a")) == 1
    for step in range(8):
        r.output_token_ids.append(50 + step)
        compute(bm, r, 1)
        assert len(bm.page_table("a")) == bm.pages_needed(r.num_computed_tokens)
    assert bm.num_used_pages == 3


def test_hash_chain_depends_on_parent():
    page = [1, 2, 3, 4]
    assert hash_page(None, page) == hash_page(None, list(page))
    assert hash_page(None, page) != hash_page(hash_page(None, page), page)
    assert hash_page(None, page) != hash_page(None, [1, 2, 3, 5])


def test_prefix_hit_on_shared_512_token_prefix():
    bm = BlockManager(num_pages=200, page_size=16)
    prefix = [1000 + i for i in range(512)]
    a = req("a", prefix + list(range(16)))  # 33 full pages
    compute(bm, a, a.num_tokens)
    a_pages = bm.page_table("a")

    b = req("b", prefix + list(range(50, 70)))
    cached = bm.get_cached_prefix(b)
    assert len(cached) * bm.page_size >= 512  # every full page of the shared prefix hits
    assert cached == a_pages[:32]
    compute(bm, b, b.num_tokens - 512, cached)
    b_pages = bm.page_table("b")
    assert b_pages[:32] == a_pages[:32] and not set(b_pages[32:]) & set(a_pages)
    assert all(bm.ref_counts[p] == 2 for p in a_pages[:32])
    assert bm.prefix_hits == 512 and bm.prefix_queries == a.num_tokens + b.num_tokens

    # The same prompt exactly: the last token is never served from the cache (it must be computed to
    # sample), so a 512-token prompt hits 31 pages.
    c = req("c", prefix)
    assert len(bm.get_cached_prefix(c)) == 31
    # After a is gone its pages stay cached (b still holds the prefix; a's tail is free but cached).
    bm.free("a")
    bm.check_invariants()
    assert all(bm.ref_counts[p] == 1 for p in a_pages[:32])
    assert bm.get_cached_prefix(req("d", prefix + list(range(16)) + [7])) == a_pages[:33]


def test_prefix_cache_disabled():
    bm = BlockManager(num_pages=50, page_size=4, enable_prefix_caching=False)
    a = req("a", range(20))
    compute(bm, a, 20)
    assert bm.get_cached_prefix(req("b", range(20))) == []
    assert not bm.hash_to_page


def test_pages_are_cached_only_once_computed():
    bm = BlockManager(num_pages=20, page_size=4)
    a = req("a", range(16))
    assert bm.allocate(a, 16) == []  # allocated, KV not written yet
    assert bm.get_cached_prefix(req("b", range(17))) == []
    a.num_computed_tokens = 16
    bm.commit(a)
    assert len(bm.get_cached_prefix(req("b", range(17)))) == 4


def test_lru_eviction_order():
    bm = BlockManager(num_pages=9, page_size=4)  # 8 usable pages
    reqs = {name: req(name, [base + i for i in range(8)]) for name, base in (("a", 0), ("b", 100), ("c", 200))}
    for r in reqs.values():
        compute(bm, r, 8)  # 2 full pages each, committed
    pages = {name: bm.page_table(name) for name in reqs}
    for name in ("a", "b", "c"):
        bm.free(name)  # freed (least recently used first): a, b, c
    bm.check_invariants()
    assert bm.num_free_pages == 8 and len(bm.hash_to_page) == 6

    # Touch a again (prefix hit) and drop it: a becomes the most recently used.
    probe = req("a2", [i for i in range(8)] + [9])
    compute(bm, probe, 1, bm.get_cached_prefix(probe))
    bm.free("a2")

    # 4 pages: 2 never-cached pages (a2's tail, the spare) go first, then the LRU cached ones: b's.
    new = req("n", [500 + i for i in range(16)])
    compute(bm, new, 16)
    assert set(pages["b"]) <= set(bm.page_table("n"))
    assert not set(pages["a"] + pages["c"]) & set(bm.page_table("n"))
    assert bm.get_cached_prefix(req("x", reqs["b"].prompt_token_ids + [1])) == []
    assert bm.get_cached_prefix(req("y", reqs["a"].prompt_token_ids + [1])) == pages["a"]
    assert bm.get_cached_prefix(req("z", reqs["c"].prompt_token_ids + [1])) == pages["c"]
    # Within a request, its tail page is evicted before its head page.
    more = req("m", [700])
    compute(bm, more, 1)
    assert bm.page_table("m") == [pages["c"][1]]
    assert bm.get_cached_prefix(req("w", reqs["c"].prompt_token_ids + [1])) == pages["c"][:1]


def test_fork_shares_pages_and_copy_on_write():
    bm = BlockManager(num_pages=20, page_size=4)
    parent = req("p", range(10))  # pages: [0..3] [4..7] [8, 9]
    compute(bm, parent, 10)
    ptable = bm.page_table("p")

    child = req("c", range(10))
    bm.fork("p", "c", 9)  # child recomputes the last prompt token itself
    child.num_computed_tokens = 9
    bm.check_invariants()
    assert bm.page_table("c") == ptable and all(bm.ref_counts[p] == 2 for p in ptable)

    # The child writes position 9, inside the shared partial last page: it gets a fresh page and a copy op.
    ops = compute(bm, child, 1)
    ctable = bm.page_table("c")
    assert ops == [(ptable[2], ctable[2])]
    assert ctable[:2] == ptable[:2] and ctable[2] != ptable[2]
    assert bm.ref_counts[ptable[2]] == 1 and bm.ref_counts[ctable[2]] == 1
    # The parent's last page is now its own again: it decodes in place, no copy.
    parent.output_token_ids.append(42)
    assert compute(bm, parent, 1) == []
    assert bm.page_table("p") == ptable

    for rid in ("p", "c"):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages


def test_copy_on_write_fails_cleanly_when_pool_is_full():
    bm = BlockManager(num_pages=4, page_size=4)  # 3 usable
    parent = req("p", range(6))
    compute(bm, parent, 6)
    bm.fork("p", "c", 5)
    child = req("c", range(6))
    child.num_computed_tokens = 5
    other = req("o", [99])
    compute(bm, other, 1)  # takes the last free page
    assert bm.allocate(child, 1) is None  # the copy needs a page
    bm.check_invariants()
    bm.free("o")
    assert compute(bm, child, 1) == [(bm.page_table("p")[1], bm.page_table("c")[1])]


def test_cached_pages_only_for_admission():
    bm = BlockManager(num_pages=20, page_size=4)
    a = req("a", range(9))
    compute(bm, a, 9)
    b = req("b", range(9))
    compute(bm, b, 1, bm.get_cached_prefix(b))
    with pytest.raises(ValueError, match="already holds pages"):
        bm.allocate(b, 1, bm.get_cached_prefix(b))
