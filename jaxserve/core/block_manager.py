"""Page allocation for the paged KV pool: free list, page tables, ref counts, prefix cache.

Plain Python over ints; the device pool itself lives in the runner. Design (after vLLM v1's block pool):

- **Null page.** Page 0 is reserved and never handed out: the runner pads page tables with it, so padded
  slots write into a page nobody reads. ``num_pages`` counts it; ``num_usable_pages == num_pages - 1``.
- **Hashes.** Each FULL page of a request gets ``sha256(parent_hash || token ids)``, chained from the
  first page, so equal hashes mean equal whole prefixes. A cryptographic hash because a collision would
  serve one tenant another tenant's KV (Python's ``hash`` of ints is trivially collidable).
- **Cache.** A page is registered under its hash once its KV is written (``commit``, after the step),
  never while it may still be in flight. Freed hashed pages stay cached in an LRU free list and are
  evicted lazily, only when a fresh page is needed; freed unhashed pages are handed out first.
- **Sharing.** Prefix hits and ``fork`` share pages (ref count > 1). Pages are written only at positions
  >= a request's ``num_computed_tokens``; if such a page is shared or cached, the writer gets a fresh
  page plus a ``(src, dst)`` copy op that the runner must apply before the step's KV writes.
- **Events.** After ``enable_kv_events()`` the cache's changes are recorded for prefix-aware routers
  (``jaxserve.core.kv_events``): ``BlockStored`` when ``commit`` registers hashes, ``BlockRemoved`` when a cached
  page is evicted; ``drain_kv_events()`` takes them. Off by default, and then nothing is recorded.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from jaxserve.core.kv_events import BlockRemoved, BlockStored
from jaxserve.core.request import Request
from jaxserve.utils import cdiv

NULL_PAGE = 0


def hash_page(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of one full page: sha256 over the parent page's hash and this page's token ids."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    """Owns page ids ``1..num_pages-1``; page 0 is the null/padding page.

    Args:
        num_pages: pages in the device pool, including the null page (so at least 2).
        page_size: tokens per page.
        enable_prefix_caching: keep full pages cached by hash for reuse across requests.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"BlockManager.num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"BlockManager.page_size must be a positive int, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        # Pages with ref count 0, in eviction order: front is handed out first (unhashed pages, then
        # cached pages least recently freed first).
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self.page_tables: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}  # per request: leading pages already offered to the cache
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # tokens found in the cache
        self.kv_events: list | None = None  # recorded cache changes, when enabled (enable_kv_events)

    # ------------------------------------------------------------------ accounting
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request (cached-but-evictable pages count as free)."""
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_usable_pages

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def pages_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def page_table(self, request_id: str) -> list[int]:
        """A copy of the request's page table (empty if it holds no pages)."""
        return list(self.page_tables.get(request_id, ()))

    # ------------------------------------------------------------------ KV events
    def enable_kv_events(self) -> None:
        """Records the prefix cache's changes from now on (``BlockStored`` / ``BlockRemoved``) until drained."""
        if self.kv_events is None:
            self.kv_events = []

    def drain_kv_events(self) -> list:
        """The events recorded since the last drain, oldest first (empty when not enabled)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def _record_stored(self, request: Request, hashes: list[bytes], indices: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly registered pages ``indices`` of the request."""
        ps, run = self.page_size, [indices[0]]
        for i in indices[1:] + [None]:
            if i is not None and i == run[-1] + 1:
                run.append(i)
                continue
            first, end = run[0], run[-1] + 1
            self.kv_events.append(
                BlockStored(
                    hashes[first:end],
                    hashes[first - 1] if first else None,
                    request.token_slice(first * ps, end * ps),
                    ps,
                )
            )
            run = [i]

    # ------------------------------------------------------------------ prefix cache
    def _hashes(self, request: Request, num_full_pages: int) -> list[bytes]:
        hashes, ps = request.page_hashes, self.page_size
        while len(hashes) < num_full_pages:
            i = len(hashes)
            hashes.append(hash_page(hashes[-1] if hashes else None, request.token_slice(i * ps, (i + 1) * ps)))
        return hashes

    def get_cached_prefix(self, request: Request) -> list[int]:
        """Pages holding the request's longest cached prefix; looks only, takes nothing.

        Only full pages count, and the last known token is always left out so that the request has at
        least one token to compute (its logits are what gets sampled).
        """
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in self._hashes(request, (request.num_tokens - 1) // self.page_size):
            page = self.hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def commit(self, request: Request) -> None:
        """Registers the request's full, computed pages in the prefix cache (call after its KV is written)."""
        if not self.enable_prefix_caching or request.request_id not in self.page_tables:
            return
        table = self.page_tables[request.request_id]
        start = self._num_committed[request.request_id]
        # Only known tokens are hashed: under async scheduling a page may hold the KV of a pending token (one a step
        # in flight samples, counted in ``num_computed_tokens`` but not in ``num_tokens``).
        known = min(request.num_computed_tokens, request.num_tokens)
        end = min(known // self.page_size, len(table))
        if end <= start:
            return
        hashes = self._hashes(request, end)
        stored = [] if self.kv_events is not None else None
        for i in range(start, end):
            page, h = table[i], hashes[i]
            # A page already hashed is a shared one; a hash already cached keeps its first page.
            if self.page_hash[page] is None and h not in self.hash_to_page:
                self.page_hash[page] = h
                self.hash_to_page[h] = page
                if stored is not None:
                    stored.append(i)
        self._num_committed[request.request_id] = end
        if stored:
            self._record_stored(request, hashes, stored)

    # ------------------------------------------------------------------ allocation
    def _take_free(self) -> int:
        page, _ = self._free.popitem(last=False)
        h = self.page_hash[page]
        if h is not None:  # lazy eviction of a cached page
            del self.hash_to_page[h]
            self.page_hash[page] = None
            if self.kv_events is not None:
                last = self.kv_events[-1] if self.kv_events else None
                if isinstance(last, BlockRemoved):
                    last.block_hashes.append(h)
                else:
                    self.kv_events.append(BlockRemoved([h]))
        self.ref_counts[page] = 1
        return page

    def _touch(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self._free[page]
        self.ref_counts[page] += 1

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self._free[page] = None  # a cached page: most recently used, evicted last
            if self.page_hash[page] is None:
                self._free.move_to_end(page, last=False)  # nothing to keep: hand it out first

    def allocate(
        self, request: Request, num_new_tokens: int, cached_pages: list[int] | tuple[int, ...] = ()
    ) -> list[tuple[int, int]] | None:
        """Makes the request's page table cover the tokens it computes this step.

        The step writes positions ``[start, start + num_new_tokens)`` where ``start`` is
        ``request.num_computed_tokens``, or ``len(cached_pages) * page_size`` when admitting a request
        with a prefix hit (``cached_pages`` from ``get_cached_prefix``; the request must hold no pages).

        Returns:
            The copy-on-write ops ``[(src_page, dst_page), ...]`` for the runner (usually empty), or None
            when the pool cannot supply the pages; nothing changes then.
        """
        rid = request.request_id
        table = self.page_tables.get(rid)
        if cached_pages and table:
            raise ValueError(f"request {rid!r} already holds pages; cached_pages are only for admission")
        start = len(cached_pages) * self.page_size if cached_pages else request.num_computed_tokens
        needed = self.pages_needed(start + num_new_tokens)
        table = table or []
        cow = [
            i
            for i in range(start // self.page_size, min(needed, len(table)))
            if self.ref_counts[table[i]] > 1 or self.page_hash[table[i]] is not None
        ]
        num_fresh = max(0, needed - len(table) - len(cached_pages)) + len(cow)
        num_revived = sum(1 for p in cached_pages if self.ref_counts[p] == 0)
        if num_fresh + num_revived > len(self._free):
            return None
        if rid not in self.page_tables:
            self.page_tables[rid] = table
            self._num_committed[rid] = len(cached_pages)
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(cached_pages) * self.page_size
        for page in cached_pages:
            self._touch(page)
            table.append(page)
        copy_ops = []
        for i in cow:
            src, dst = table[i], self._take_free()
            copy_ops.append((src, dst))
            table[i] = dst
            self._release(src)
        while len(table) < needed:
            table.append(self._take_free())
        return copy_ops

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Gives ``child_id`` the parent's pages covering positions ``[0, num_tokens)``, shared (ref + 1)."""
        if child_id in self.page_tables:
            raise ValueError(f"request {child_id!r} already holds pages")
        shared = self.page_tables[parent_id][: self.pages_needed(num_tokens)]
        for page in shared:
            self._touch(page)
        self.page_tables[child_id] = list(shared)
        self._num_committed[child_id] = num_tokens // self.page_size

    def free(self, request_id: str) -> None:
        """Drops the request's pages (no-op if it holds none). Tail pages are freed first so that they are
        evicted before the prefix pages other requests are likelier to share."""
        table = self.page_tables.pop(request_id, None)
        self._num_committed.pop(request_id, None)
        for page in reversed(table or ()):
            self._release(page)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Asserts the bookkeeping is consistent (for tests and debugging; O(pages))."""
        refs = [0] * self.num_pages
        for table in self.page_tables.values():
            for page in table:
                assert page != NULL_PAGE, "the null page was handed out"
                refs[page] += 1
        assert refs == self.ref_counts, "ref counts disagree with the page tables"
        assert set(self._free) == {p for p in range(1, self.num_pages) if refs[p] == 0}, "free list is wrong"
        assert self.num_free_pages + self.num_used_pages == self.num_usable_pages
        for h, page in self.hash_to_page.items():
            assert self.page_hash[page] == h, f"page {page} hash mismatch"
        assert sum(h is not None for h in self.page_hash) == len(self.hash_to_page)
