"""Scheduler driven by a fake runner: budgets, chunked prefill, preemption, policies, stops, fork. No jax.

The fake runner keeps a host-side page pool whose slot values chain from the previous position's value
(as real KV depends on the whole prefix) and samples from the last one, so any wrong page table, shared
page or missing copy changes the sampled tokens and shows up against ``reference``.
"""

import dataclasses

import pytest
from helpers import SP
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.config import SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sched.async_scheduler import make_scheduler


def kv(prev, token):
    return hash((prev, token))


def next_token(value, seed, vocab):
    return 2 + hash((value, seed)) % vocab


class FakeRunner:
    """A runner that knows only what the scheduler's outputs tell it (new requests, page-table changes, finished
    and preempted ids), as the real one, and checks that this is enough: its own page tables address exactly
    the KV it computed, and its own token record matches the tokens it is asked to compute."""

    def __init__(self, bm, vocab=1000):
        self.ps, self.vocab = bm.page_size, vocab
        self.pool = [[None] * bm.page_size for _ in range(bm.num_pages)]
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.params: dict = {}

    def _update(self, out):
        for rid in (*out.finished_req_ids, *out.preempted_req_ids):
            self.tables.pop(rid, None), self.tokens.pop(rid, None), self.params.pop(rid, None)
        for s in out.scheduled:
            if s.new is not None:
                assert s.req_id not in self.tables, f"{s.req_id} started twice"
                self.tables[s.req_id] = []
                self.tokens[s.req_id] = s.new.prompt_token_ids + s.new.output_token_ids
                self.params[s.req_id] = s.new.sampling_params
            table = self.tables[s.req_id]
            assert s.pages_from <= len(table), "a page-table change must not leave a gap"
            table[s.pages_from :] = s.new_page_ids

    def __call__(self, out):
        self._update(out)
        copies = [list(self.pool[src]) for src, _ in out.copy_ops]  # all copies before any write
        for (_, dst), data in zip(out.copy_ops, copies):
            self.pool[dst] = data
        sampled = {}
        for s in out.scheduled:
            table, end, last = self.tables[s.req_id], s.start_pos + len(s.token_ids), s.start_pos - 1
            assert len(table) >= -(-end // self.ps) and 0 not in table
            assert self.tokens[s.req_id][s.start_pos : end] == s.token_ids, f"{s.req_id}: token record out of step"
            value = self.pool[table[last // self.ps]][last % self.ps] if s.start_pos else 0
            assert value is not None, f"{s.req_id}: KV before position {s.start_pos} was never computed"
            for pos, token in enumerate(s.token_ids, s.start_pos):
                value = kv(value, token)
                self.pool[table[pos // self.ps]][pos % self.ps] = value
            if s.sample:
                sampled[s.req_id] = [next_token(value, self.params[s.req_id].seed, self.vocab)]
                self.tokens[s.req_id].append(sampled[s.req_id][0])
        return sampled


def reference(request, max_model_len, vocab=1000):
    """What the request must generate: same chain, no pages, same stop rules."""
    sp, value, out = request.sampling_params, 0, []
    for token in request.prompt_token_ids:
        value = kv(value, token)
    while True:
        token = next_token(value, sp.seed, vocab)
        out.append(token)
        eos = () if sp.ignore_eos else request.eos_token_ids
        if len(out) >= sp.min_tokens and (token in sp.stop_token_ids or token in eos):
            return out, "stop"
        if len(out) >= sp.max_tokens or request.num_prompt_tokens + len(out) >= max_model_len:
            return out, "length"
        value = kv(value, token)


def make(num_pages=64, page_size=4, caching=True, **cfg):
    config = SchedulerConfig(enable_prefix_caching=caching, **cfg)
    bm = BlockManager(num_pages, page_size, caching)
    return make_scheduler(config, bm), FakeRunner(bm)


def step(sched, runner, log=None):
    was_running = {r.request_id for r in sched.running}
    out = sched.schedule()
    if out.preempted_req_ids:  # no admissions in a step that had to preempt
        assert {s.req_id for s in out.scheduled} <= was_running - set(out.preempted_req_ids)
    cfg, log = sched.config, [] if log is None else log
    assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    log.append(out)
    return out, sched.update_from_output(out, runner(out))


def run(sched, runner, max_steps=10_000, log=None):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        finished.update((r.request_id, r) for r in step(sched, runner, log)[1])
    raise AssertionError("requests did not finish")


def check_done(sched, finished, requests):
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages and not bm.page_tables
    for r in requests:
        assert (r.output_token_ids, r.finish_reason) == reference(r, sched.config.max_model_len), r
        assert finished[r.request_id] is r


def prompt(n, base=0):
    return [base + i for i in range(n)]


def test_budgets_respected_and_outputs_exact():
    sched, runner = make(max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [Request(f"r{i}", prompt(5 + 13 * i, 100 * i), SP(max_tokens=3 + i)) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    log = []
    check_done(sched, run(sched, runner, log=log), reqs)
    assert max(o.num_scheduled_tokens for o in log) == 64 and max(len(o.scheduled) for o in log) == 4


def test_chunked_prefill_1500_tokens_budget_128():
    sched, runner = make(num_pages=400, page_size=16, max_num_batched_tokens=128, max_model_len=2048)
    r = Request("long", prompt(1500), SP(max_tokens=5))
    sched.add_request(r)
    log = []
    finished = run(sched, runner, log=log)
    chunks = [(o.scheduled[0].start_pos, o.num_scheduled_tokens, o.scheduled[0].sample) for o in log]
    assert chunks[:12] == [(128 * i, 128, False) for i in range(11)] + [(1408, 92, True)]
    assert chunks[12:] == [(1500 + i, 1, True) for i in range(4)]
    assert len(log) == 16 and sum(o.num_scheduled_tokens for o in log) == 1504
    check_done(sched, finished, [r])


def test_mixed_prefill_and_decode_in_one_step():
    sched, runner = make(max_num_batched_tokens=32)
    a = Request("a", prompt(8), SP(max_tokens=20))
    sched.add_request(a)
    step(sched, runner)  # a's prefill
    b = Request("b", prompt(100, 1000), SP(max_tokens=2))
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert [(s.req_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("a", 1, True), ("b", 31, False)]
    check_done(sched, run(sched, runner), [a, b])


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_when_pool_too_small(caching, policy):
    # 12 usable pages of 4 tokens; each request may need up to 8 pages.
    sched, runner = make(num_pages=13, caching=caching, policy=policy, max_num_batched_tokens=16)
    reqs = [Request(f"r{i}", prompt(10 + i, 50 * i), SP(max_tokens=18), priority=i % 3) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    finished = run(sched, runner)
    assert sched.stats().num_preemptions > 0 and sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    check_done(sched, finished, reqs)
    assert sched.stats().num_used_pages == 0


@pytest.mark.parametrize("policy, expected", [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])])
def test_policy_order(policy, expected):
    sched, runner = make(policy=policy, max_num_seqs=1)
    for rid, priority in (("a", 3), ("b", 1), ("c", 2)):
        sched.add_request(Request(rid, prompt(6), SP(max_tokens=2), priority=priority))
    order = []
    while sched.has_unfinished_requests():
        order += [r.request_id for r in step(sched, runner)[1]]
    assert order == expected


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_preemption_victim(policy, victim):
    sched, runner = make(num_pages=5, policy=policy, max_num_batched_tokens=64)  # 4 pages of 4
    low = Request("low", prompt(7, 100), SP(max_tokens=9), priority=5)
    high = Request("high", prompt(7, 200), SP(max_tokens=9), priority=0)
    sched.add_request(low)
    step(sched, runner)  # low is admitted first: the oldest, but the lowest priority
    sched.add_request(high)
    preempted, finished = [], {}
    while sched.has_unfinished_requests():
        out, done = step(sched, runner)
        preempted += out.preempted_req_ids
        finished.update((r.request_id, r) for r in done)
    assert preempted and set(preempted) == {victim}
    check_done(sched, finished, [low, high])


def test_abort_frees_pages_for_waiting_and_running():
    sched, runner = make(max_num_seqs=1)
    a, b = Request("a", prompt(20), SP()), Request("b", prompt(20, 500), SP())
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.block_manager.num_used_pages == 5 and b.status is RequestStatus.WAITING
    assert sched.abort_request("b") is b and b.finish_reason == "abort"
    out = sched.schedule()
    assert sched.abort_request("a") is a and a.finish_reason == "abort"  # aborted mid-step
    assert sched.block_manager.num_used_pages == 0 and not sched.has_unfinished_requests()
    assert sched.update_from_output(out, runner(out)) == []
    assert out.finished_req_ids == ["b"] and sched.schedule().finished_req_ids == ["a"]
    assert sched.abort_request("a") is None


def test_max_model_len():
    sched, runner = make(max_model_len=100)
    for n in (101, 100):  # a prompt of max_model_len tokens leaves no room to generate (the engine's rule too)
        with pytest.raises(ValueError, match=rf"'x': the prompt has {n} tokens.*no room.*max_model_len=100"):
            sched.add_request(Request("x", prompt(n), SP()))
    capped = Request("capped", prompt(90), SP(max_tokens=50))
    full = Request("full", prompt(99), SP(max_tokens=50))  # room to sample exactly one token
    sched.add_request(capped)
    sched.add_request(full)
    check_done(sched, run(sched, runner), [capped, full])
    assert (capped.num_output_tokens, capped.finish_reason) == (10, "length")
    assert (full.num_output_tokens, full.finish_reason) == (1, "length")


def test_rejections():
    sched, _ = make(num_pages=5, max_model_len=64)  # 4 pages of 4 tokens
    with pytest.raises(ValueError, match="only 4 pages"):
        sched.add_request(Request("big", prompt(10), SP(max_tokens=20)))
    sched.add_request(Request("ok", prompt(10), SP(max_tokens=7)))  # 16 tokens computed at most
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("ok", prompt(3), SP()))
    with pytest.raises(ValueError, match="empty"):
        Request("e", [], SP())
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_scheduler(SchedulerConfig(enable_prefix_caching=True), BlockManager(8, 4, False))


def test_stop_conditions():
    sched, runner = make(max_model_len=512)
    base = Request("base", prompt(5), SP(max_tokens=30, ignore_eos=True))
    sched.add_request(base)
    run(sched, runner)
    t = base.output_token_ids  # the deterministic continuation of this prompt
    eos = Request("eos", prompt(5), SP(max_tokens=30), eos_token_ids=[t[3]])
    late = Request("late", prompt(5), SP(max_tokens=30, min_tokens=6), eos_token_ids=[t[3]])
    ign = Request("ign", prompt(5), SP(max_tokens=7, ignore_eos=True), eos_token_ids=[t[3]])
    stop = Request("stop", prompt(5), SP(max_tokens=30, stop_token_ids=[t[2]]))
    for r in (eos, late, ign, stop):
        sched.add_request(r)
    check_done(sched, run(sched, runner), [eos, late, ign, stop])
    assert eos.output_token_ids == t[:4] and eos.finish_reason == "stop"
    assert late.num_output_tokens >= 6 and ign.output_token_ids == t[:7] and ign.finish_reason == "length"
    assert stop.output_token_ids == t[:3] and stop.finish_reason == "stop"
    r = Request("engine-stop", prompt(5), SP(max_tokens=30))
    sched.add_request(r)
    step(sched, runner)
    assert sched.finish_request("engine-stop", "stop") is r and r.status is RequestStatus.FINISHED_STOPPED
    assert sched.block_manager.num_used_pages == 0


def test_prefix_cache_hit_through_scheduler():
    sched, runner = make(num_pages=200, page_size=16, max_num_batched_tokens=1024, max_model_len=1024)
    shared = prompt(512, 7)
    a = Request("a", shared + [1, 2, 3], SP(max_tokens=4))
    sched.add_request(a)
    run(sched, runner)
    b = Request("b", shared + [9, 9], SP(max_tokens=4))
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert out.scheduled[0].start_pos == 512 and out.scheduled[0].token_ids == [9, 9]
    check_done(sched, run(sched, runner), [b])
    assert b.num_cached_tokens == 512 and sched.stats().prefix_cache_hits == 512


def test_fork_children_copy_on_write():
    sched, runner = make(page_size=4)
    parent = Request("p", prompt(10), SP(max_tokens=6, seed=0))
    sched.add_request(parent)
    step(sched, runner)  # prefill: 10 tokens computed, first token sampled
    kids = [Request(f"k{i}", prompt(10), SP(max_tokens=6, seed=i + 1)) for i in range(2)]
    for kid in kids:
        sched.fork_request("p", kid)
    assert all(sched.block_manager.ref_counts[pg] == 3 for pg in sched.block_manager.page_table("p"))
    out, _ = step(sched, runner)
    assert [len(s.token_ids) for s in out.scheduled] == [1, 1, 1] and len(out.copy_ops) == 2
    check_done(sched, run(sched, runner), [parent, *kids])
    assert kids[0].output_token_ids != kids[1].output_token_ids and kids[0].num_cached_tokens == 9


# ("add", prompt_len, max_tokens, priority (also min_tokens), shared-prefix id); long ones make preemption likely.
ADD = st.tuples(
    st.just("add"),
    st.integers(1, 40) | st.integers(20, 40),
    st.integers(1, 12) | st.integers(8, 12),
    st.integers(0, 2),
    st.integers(0, 2),
)
STEP = st.tuples(st.just("step"), st.none() | st.integers(0, 30))
OPS = st.one_of(ADD, STEP, ADD, STEP, st.tuples(st.sampled_from(["abort", "finish", "fork"]), st.integers(0, 30)))


MAX_LEN, VOCAB, EOS = 48, 12, (5,)


def _small_pool(caching, page_size, spare_pages, budget, max_seqs, **cfg):
    """A scheduler over a pool of one longest sequence (MAX_LEN tokens) plus ``spare_pages``: preemption."""
    sched, _ = make(
        num_pages=1 + -(-MAX_LEN // page_size) + spare_pages,
        page_size=page_size,
        caching=caching,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        **cfg,
    )
    return sched


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(OPS, min_size=12, max_size=60),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    page_size=st.sampled_from([1, 2, 4, 8]),
    spare_pages=st.integers(0, 6) | st.integers(0, 30),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
)
def test_random_operations_never_leak_or_lose(ops, policy, caching, page_size, spare_pages, budget, max_seqs):
    max_len, vocab, eos = MAX_LEN, 40, EOS
    sched = _small_pool(caching, page_size, spare_pages, budget, max_seqs, policy=policy)
    runner = FakeRunner(sched.block_manager, vocab)
    bm, added, done, external = sched.block_manager, [], {}, set()  # external: aborted/finished by the engine
    pick = lambda i, pool: pool[i % len(pool)] if pool else None  # noqa: E731

    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, prio, prefix = op
            sp = SP(max_tokens, min_tokens=prio, seed=len(added))
            r = Request(f"r{len(added)}", prompt(n, 100 * prefix), sp, eos, priority=prio)
            sched.add_request(r)
            added.append(r)
        elif op[0] == "step":
            out = sched.schedule()
            assert out.num_scheduled_tokens <= budget and len(out.scheduled) <= max_seqs
            victim = pick(op[1], sorted(sched.requests)) if op[1] is not None else None
            if victim is not None:  # aborted between schedule() and update_from_output()
                done[victim] = sched.abort_request(victim)
                external.add(victim)
            done.update((r.request_id, r) for r in sched.update_from_output(out, runner(out)))
        elif op[0] == "fork":
            parent = pick(op[1], [r for r in sched.running if r.num_computed_tokens > 0])
            if parent is not None:
                kid = Request(f"r{len(added)}", parent.prompt_token_ids, SP(4, seed=len(added)), eos)
                sched.fork_request(parent.request_id, kid)
                added.append(kid)
        else:
            rid = pick(op[1], sorted(sched.requests))
            if rid is not None:
                done[rid] = sched.finish_request(rid, "abort" if op[0] == "abort" else "stop")
                external.add(rid)
        bm.check_invariants()
        assert set(sched.requests) | set(done) == {r.request_id for r in added}
        assert set(sched.requests) == {r.request_id for r in [*sched.waiting, *sched.running]}
        assert len(sched.running) <= max_seqs and all(not bm.page_table(r.request_id) for r in sched.waiting)
        for r in sched.running:
            assert len(bm.page_table(r.request_id)) >= bm.pages_needed(r.num_computed_tokens)
    done.update(run(sched, runner))
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages and not bm.page_tables and not sched.requests
    for r in added:
        expected, reason = reference(r, max_len, vocab)
        assert done[r.request_id] is r and r.is_finished
        if r.request_id in external:
            assert r.output_token_ids == expected[: r.num_output_tokens], r  # nothing wrong so far
        else:
            assert (r.output_token_ids, r.finish_reason) == (expected, reason), r  # nothing lost


# ---------------------------------------------------------------- async scheduling


class AsyncFakeRunner(FakeRunner):
    """The fake runner under async scheduling: a chunk ``from_previous_step`` starts with the token it sampled last
    for that request (the real runner reads it on the device), which it knows and the scheduler does not yet."""

    def __call__(self, out):
        self._update(out)
        fed = []
        for s in out.scheduled:
            if s.from_previous_step:
                assert s.token_ids == [] and s.num_tokens == 1, "only a decode's one token can be pending"
                assert len(self.tokens[s.req_id]) == s.start_pos + 1, "the fed token is not the last one sampled"
                token = self.tokens[s.req_id][s.start_pos]
                fed.append(dataclasses.replace(s, token_ids=[token], from_previous_step=False))
            else:
                assert all(t >= 0 for t in s.token_ids), s
                fed.append(s)
        self._update = lambda _: None  # already applied
        try:
            return super().__call__(dataclasses.replace(out, scheduled=fed))
        finally:
            del self._update


def _small_pool_case(runner_cls, lengths, caching, page_size, spare_pages, budget, max_seqs, **cfg):
    """The scheduler, fake runner and requests of the property tests: prompts of two families (shared prefixes), stops
    (EOS 5 in a vocabulary of 12, min_tokens), a pool of one longest sequence plus ``spare_pages`` (preemption)."""
    sched = _small_pool(caching, page_size, spare_pages, budget, max_seqs, **cfg)
    reqs = [
        Request(f"r{i}", prompt(n, 7 * (i % 2)), SP(max_tokens, min_tokens=m, seed=i), EOS, priority=i % 3)
        for i, (n, max_tokens, m) in enumerate(lengths)
    ]
    sched.add_requests(reqs)
    return sched, runner_cls(sched.block_manager, VOCAB), reqs


def run_async(sched, runner, max_steps=10_000):
    """Each step scheduled before the previous one's tokens reach the scheduler, as the engine does."""
    finished, in_flight = {}, None
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            return finished
        out = sched.schedule()
        assert len(out.scheduled) <= sched.config.max_num_seqs
        for r in sched.requests.values():  # pending tokens are counted, never written as token ids
            assert all(t >= 0 for t in r.output_token_ids) and r.num_pending <= 2, r
        launched = (out, runner(out))  # the runner always hears of finished and preempted requests
        launched = launched if out.scheduled else None
        if in_flight is not None:
            finished.update((r.request_id, r) for r in sched.update_from_output(*in_flight))
        in_flight = launched
        sched.block_manager.check_invariants()
    raise AssertionError("requests did not finish")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=10),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    page_size=st.sampled_from([1, 2, 4]),
    spare_pages=st.integers(0, 20),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 5),
)
def test_async_scheduling_generates_what_sync_does(lengths, policy, caching, page_size, spare_pages, budget, max_seqs):
    """Against ``reference`` (the chain without pages): every request's tokens and finish reason, with stops
    (EOS 5 in a vocabulary of 12, min_tokens), preemption in small pools, shared prefixes; all pages freed."""
    sched, runner, reqs = _small_pool_case(
        AsyncFakeRunner,
        lengths,
        caching,
        page_size,
        spare_pages,
        budget,
        max_seqs,
        policy=policy,
        async_scheduling=True,
    )
    max_len, vocab = MAX_LEN, VOCAB
    done = run_async(sched, runner)
    bm = sched.block_manager
    assert bm.num_free_pages == bm.num_usable_pages and not bm.page_tables and not sched.requests
    for r in reqs:
        assert done[r.request_id] is r and r.num_pending == 0
        assert (r.output_token_ids, r.finish_reason) == reference(r, max_len, vocab), r


def test_async_scheduling_pending_token_then_stop():
    """A stop confirmed one step late: the token the next step computed is dropped, never kept."""
    sched, runner = make(async_scheduling=True)
    runner = AsyncFakeRunner(sched.block_manager)
    r = Request("a", prompt(6), SP(max_tokens=50, seed=1), eos_token_ids=())
    sched.add_request(r)
    first = sched.schedule()
    assert r.output_token_ids == [] and r.num_pending == 1 and r.num_computed_tokens == 6
    assert (r.num_tokens, r.num_tokens_with_pending) == (6, 7)
    first_tokens = runner(first)
    second = sched.schedule()  # before the first step's token is known
    [s] = second.scheduled
    assert (s.token_ids, s.from_previous_step, s.start_pos, s.sample) == ([], True, 6, True)
    assert r.output_token_ids == [] and r.num_pending == 2 and r.num_computed_tokens == 7
    second_tokens = runner(second)
    # The first token is a stop token for this request: it finishes, and the second step's token is dropped.
    r.sampling_params = SP(max_tokens=50, seed=1, stop_token_ids=first_tokens["a"])
    assert sched.update_from_output(first, first_tokens) == [r]
    assert r.output_token_ids == first_tokens["a"] and r.finish_reason == "stop" and r.num_pending == 0
    assert sched.update_from_output(second, second_tokens) == [] and r.output_token_ids == first_tokens["a"]
    assert sched.block_manager.num_free_pages == sched.block_manager.num_usable_pages


def test_async_preemption_keeps_the_pending_token():
    """A request preempted while a step in flight samples its token loses nothing: the token is confirmed into
    its outputs when that step is read, and only then does it resume, its tokens all known."""
    sched, _ = make(num_pages=1 + 4, page_size=2, caching=False, async_scheduling=True, max_num_seqs=2)
    runner = AsyncFakeRunner(sched.block_manager)
    a, b = (Request(rid, prompt(3, 10 * i), SP(max_tokens=6, seed=i), ()) for i, rid in enumerate("ab"))
    sched.add_requests([a, b])
    first = sched.schedule()  # both prefilled: 2 pages each, the pool is full
    first_tokens = runner(first)
    second = sched.schedule()  # both decode their pending token at position 3: still 2 pages each
    assert [s.from_previous_step for s in second.scheduled] == [True, True]
    second_tokens = runner(second)
    sched.update_from_output(first, first_tokens)
    third = sched.schedule()  # a needs a third page for position 4: b, the newest, is preempted
    assert third.preempted_req_ids == ["b"] and b.status is RequestStatus.PREEMPTED
    assert b.num_pending == 1 and b.num_computed_tokens == 0 and b.output_token_ids == first_tokens["b"]
    third_tokens = runner(third)
    sched.update_from_output(second, second_tokens)  # b's pending token is confirmed, kept
    assert b.num_pending == 0 and b.output_token_ids == first_tokens["b"] + second_tokens["b"]
    done = {r.request_id: r for r in sched.update_from_output(third, third_tokens)}
    in_flight = None
    while sched.has_unfinished_requests() or in_flight:
        out = sched.schedule()
        resumed = [s for s in out.scheduled if s.req_id == "b" and s.new is not None]
        if resumed:  # resumed from all of its tokens, none pending
            assert resumed[0].new.output_token_ids == b.output_token_ids[:2] and not resumed[0].from_previous_step
        launched = (out, runner(out)) if out.scheduled else None
        if in_flight:
            done.update((r.request_id, r) for r in sched.update_from_output(*in_flight))
        in_flight = launched
    for r in (a, b):
        assert done[r.request_id] is r
        assert (r.output_token_ids, r.finish_reason) == reference(r, sched.config.max_model_len), r


def test_async_prefix_cache_hashes_known_tokens_only():
    """A page whose last position holds a pending token's KV is hashed once that token is confirmed."""
    sched, _ = make(num_pages=16, page_size=2, async_scheduling=True)
    runner = AsyncFakeRunner(sched.block_manager)
    bm = sched.block_manager
    r = Request("a", prompt(3), SP(max_tokens=8, seed=1), ())
    sched.add_request(r)
    first = sched.schedule()
    first_tokens = runner(first)
    second = sched.schedule()  # computes position 3 (the pending token): page 1 is full of KV, half of it unknown
    second_tokens = runner(second)
    assert r.num_computed_tokens == 4 and r.num_tokens == 3 and r.num_pending == 2
    bm.commit(r)  # now: only page 0 is full of known tokens
    assert len(r.page_hashes) == 1 and len(bm.hash_to_page) == 1
    sched.update_from_output(first, first_tokens)  # position 3's token is known now: page 1 may be hashed
    assert r.num_tokens == 4 and r.num_pending == 1 and len(r.page_hashes) == 2
    assert len(bm.hash_to_page) == 2
    sched.update_from_output(second, second_tokens)
    assert r.num_pending == 0 and len(bm.hash_to_page) == 2  # position 4's page is not full


def run_pipelined(sched, runner, stages, max_ticks=10_000, abort=None):
    """Drives the scheduler as pipeline stages do: each tick launches a step into the first stage, and the step
    launched ``stages - 1`` ticks earlier leaves the last one at the end of the tick (its tokens reach the
    scheduler then). ``abort``: (tick, request id) aborted before that tick's step. Returns (finished requests,
    ticks until the last step that computed anything left, steps that computed anything)."""
    from collections import deque

    finished, in_flight, last_exit, steps = {}, deque(), -1, 0
    for tick in range(max_ticks):
        if not sched.has_unfinished_requests() and not any(o.scheduled for o, _ in in_flight):
            return finished, last_exit + 1, steps
        if abort is not None and tick == abort[0]:
            sched.abort_request(abort[1])
        out = sched.schedule()
        sampling = {s.req_id for o, _ in in_flight for s in o.scheduled if s.sample}
        assert not sampling & {s.req_id for s in out.scheduled}, "a request with a token in flight was scheduled"
        assert len(out.scheduled) <= sched.config.max_num_seqs
        assert not any(s.from_previous_step for s in out.scheduled)
        in_flight.append((out, runner(out)))
        steps += bool(out.scheduled)
        if len(in_flight) == stages:
            done, tokens = in_flight.popleft()
            finished.update((r.request_id, r) for r in sched.update_from_output(done, tokens))
            if done.scheduled:
                last_exit = tick
        sched.block_manager.check_invariants()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_pipeline_keeps_a_batch_on_every_stage(stages):
    """S batches of 2 requests, each request 1 prefill + 5 decode steps: S x 6 steps launched back to back take
    S x 6 + S - 1 ticks (each tick one step enters, the pipeline drains once); exact tokens."""
    sched, runner = make(max_num_seqs=2, pipeline_stages=stages)
    reqs = [Request(f"r{i}", prompt(4, 10 * i), SP(max_tokens=6, seed=i), ()) for i in range(2 * stages)]
    sched.add_requests(reqs)
    finished, ticks, steps = run_pipelined(sched, runner, stages)
    check_done(sched, finished, reqs)
    assert steps == stages * 6 and ticks == steps + stages - 1


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_one_batch_in_flight_shows_the_bubble(stages):
    """One batch of 2 requests: each of its 6 steps waits for the previous one's tokens, S ticks apart: 6 x S
    ticks, S - 1 of every S idle."""
    sched, runner = make(max_num_seqs=2, pipeline_stages=stages)
    reqs = [Request(f"r{i}", prompt(4, 10 * i), SP(max_tokens=6, seed=i), ()) for i in range(2)]
    sched.add_requests(reqs)
    finished, ticks, steps = run_pipelined(sched, runner, stages)
    check_done(sched, finished, reqs)
    assert steps == 6 and ticks == 6 * stages


def test_pipeline_prompt_chunks_follow_one_another():
    """A long prompt's chunks sample nothing until the last: they go into consecutive steps, not S apart."""
    sched, runner = make(max_num_batched_tokens=8, pipeline_stages=3)
    r = Request("long", prompt(30), SP(max_tokens=2, seed=3), ())
    sched.add_request(r)
    starts = []
    for _ in range(4):  # chunks of 8, 8, 8, 6: the last samples
        out = sched.schedule()
        runner(out)
        starts.append([(s.start_pos, s.sample) for s in out.scheduled])
    assert starts == [[(0, False)], [(8, False)], [(16, False)], [(24, True)]]
    assert sched.schedule().scheduled == []  # its token is in flight


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=10),
    stages=st.sampled_from([2, 3, 5]),
    caching=st.booleans(),
    page_size=st.sampled_from([1, 2, 4]),
    spare_pages=st.integers(0, 20),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 5),
    abort=st.integers(-1, 9),
)
def test_pipeline_generates_what_one_step_at_a_time_does(
    lengths, stages, caching, page_size, spare_pages, budget, max_seqs, abort
):
    """Against ``reference``: every request's tokens and finish reason with S steps in flight, with stops (EOS 5 of
    12), preemption in small pools, shared prefixes, chunked prompts and one request aborted mid-flight; all pages
    freed."""
    sched, runner, reqs = _small_pool_case(
        FakeRunner, lengths, caching, page_size, spare_pages, budget, max_seqs, pipeline_stages=stages
    )
    max_len, vocab = MAX_LEN, VOCAB
    aborted = reqs[abort] if 0 <= abort < len(reqs) else None
    finished, _, _ = run_pipelined(sched, runner, stages, abort=aborted and (2, aborted.request_id))
    bm = sched.block_manager
    assert bm.num_free_pages == bm.num_usable_pages and not bm.page_tables and not sched.requests
    for r in reqs:
        if r is aborted and r.finish_reason == "abort":  # (unless it had finished before tick 2)
            assert r.num_pending == 0 and r.request_id not in finished
            continue
        assert finished[r.request_id] is r and r.num_pending == 0
        assert (r.output_token_ids, r.finish_reason) == reference(r, max_len, vocab), r
