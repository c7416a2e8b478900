"""KV-cache events for prefix-aware routers: what the block manager records, the wire format (decoded here with
plain msgpack, not our encoder's types), and the ZMQ publisher behind ``--kv-events-config``. No model, no jax."""

from __future__ import annotations

import json
import random
import socket
import sys
import time

import pytest
from helpers import SP

from jaxserve.core.block_manager import BlockManager, hash_page
from jaxserve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    encode_batch,
    external_hash,
)
from jaxserve.core.request import Request

msgpack = pytest.importorskip("msgpack")


def req(rid, tokens):
    return Request(rid, list(tokens), SP(max_tokens=16))


def compute(bm, r, n, cached=()):
    """Allocates and 'runs' n tokens of r, then commits, as the scheduler does; False when the pool is full."""
    start = len(cached) * bm.page_size if cached else r.num_computed_tokens
    if bm.allocate(r, n, cached) is None:
        return False
    r.num_computed_tokens = start + n
    bm.commit(r)
    return True


class Router:
    """What a prefix-aware router keeps from the events: the set of cached page hashes."""

    def __init__(self):
        self.cached: set[bytes] = set()

    def apply(self, events):
        for e in events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                h = e.parent_block_hash  # the chain: each hash is hash_page(previous, its tokens)
                for i, stored in enumerate(e.block_hashes):
                    h = hash_page(h, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                    assert stored == h
                assert not self.cached & set(e.block_hashes), "a stored hash was already cached"
                self.cached |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.cached, "a removed hash was not cached"
                self.cached -= set(e.block_hashes)
            else:
                self.cached.clear()


# ---------------------------------------------------------------------------------------------------- block manager
def test_nothing_is_recorded_unless_enabled():
    bm = BlockManager(num_pages=4, page_size=4)
    a = req("a", range(9))
    assert compute(bm, a, 9) and bm.kv_events is None and bm.drain_kv_events() == []
    bm.free("a")
    assert compute(bm, req("b", range(100, 108)), 8)  # evicts one of a's cached pages
    assert bm.kv_events is None and bm.drain_kv_events() == [] and len(bm.hash_to_page) == 3


def test_stored_pages_carry_their_hashes_parents_and_tokens_and_evictions_remove_them():
    bm = BlockManager(num_pages=5, page_size=4)  # 4 usable pages
    bm.enable_kv_events()
    tokens = list(range(10, 20))
    a = req("a", tokens)
    assert compute(bm, a, 10)  # pages 0 and 1 are full
    table = bm.page_table("a")
    h0, h1 = hash_page(None, tokens[:4]), hash_page(hash_page(None, tokens[:4]), tokens[4:8])
    assert [bm.page_hash[p] for p in table[:2]] == [h0, h1]
    assert bm.drain_kv_events() == [BlockStored([h0, h1], None, tokens[:8], 4)]
    assert bm.drain_kv_events() == []
    for t in (20, 21):  # decode to 12 tokens: page 2 fills
        a.output_token_ids.append(t)
        assert compute(bm, a, 1)
    h2 = hash_page(h1, [18, 19, 20, 21])
    assert bm.drain_kv_events() == [BlockStored([h2], h1, [18, 19, 20, 21], 4)]
    bm.free("a")  # its pages stay cached
    assert bm.drain_kv_events() == []
    assert compute(bm, req("b", range(100, 116)), 16)  # needs all 4 pages: one never used, then 3 evicted
    # Tail pages were freed first, so they are evicted first; the removals come in one event, before b's pages.
    removed, stored = bm.drain_kv_events()
    assert removed == BlockRemoved([h2, h1, h0]) and stored.parent_block_hash is None
    assert stored.block_hashes == [bm.page_hash[p] for p in bm.page_table("b")] and len(bm.hash_to_page) == 4


def test_a_hash_already_cached_or_a_shared_page_is_not_stored_again():
    bm = BlockManager(num_pages=16, page_size=4)
    bm.enable_kv_events()
    tokens = list(range(12))
    a, b = req("a", tokens), req("b", tokens)
    assert compute(bm, a, 12) and compute(bm, b, 12)  # same prompt, both computed: b's pages hold cached hashes
    (stored,) = bm.drain_kv_events()
    assert stored.block_hashes == [bm.page_hash[p] for p in bm.page_table("a")]
    c = req("c", tokens + [50, 51, 52, 53, 54])
    cached = bm.get_cached_prefix(c)
    assert len(cached) == 3 and compute(bm, c, 17 - 12, cached)  # a prefix hit, then page 3 fills
    (stored,) = bm.drain_kv_events()
    assert stored.block_hashes == [hash_page(bm.page_hash[cached[-1]], [50, 51, 52, 53])]
    assert stored.parent_block_hash == bm.page_hash[cached[-1]] and stored.token_ids == [50, 51, 52, 53]


@pytest.mark.parametrize("seed", range(3))
def test_replaying_the_events_tracks_the_cache_exactly(seed):
    """Random requests (shared prefixes, prefix hits, decodes, frees) on a small pool: after every operation, a
    router that replays the events holds exactly the block manager's cached hashes."""
    rng = random.Random(seed)
    bm = BlockManager(num_pages=12, page_size=4)
    bm.enable_kv_events()
    router, live = Router(), {}
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    for step in range(300):
        if live and (rng.random() < 0.3 or len(live) > 3):
            rid = rng.choice(sorted(live))
            bm.free(rid)
            del live[rid]
        elif live and rng.random() < 0.6:
            r = live[rng.choice(sorted(live))]
            r.output_token_ids.append(rng.randrange(1000))
            if not compute(bm, r, 1):
                bm.free(r.request_id)
                del live[r.request_id]
        else:
            r = req(f"r{step}", rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 6))])
            cached = bm.get_cached_prefix(r)
            start = len(cached) * bm.page_size
            if compute(bm, r, r.num_tokens - start, cached):
                live[r.request_id] = r
        bm.check_invariants()
        router.apply(bm.drain_kv_events())
        assert router.cached == set(bm.hash_to_page), step
    assert bm.prefix_hits > 0


# ---------------------------------------------------------------------------------------------------- wire format
def test_the_array_encoding_is_vllms_tagged_arrays():
    h = [hash_page(None, [1, 2]), hash_page(hash_page(None, [1, 2]), [3, 4])]
    events = [BlockStored(h, None, [1, 2, 3, 4], 2), BlockRemoved([h[1]]), AllBlocksCleared()]
    batch = msgpack.unpackb(encode_batch(1.5, events, 0, "array"))
    ints = [int.from_bytes(x[-8:], "big") for x in h]
    assert batch == [
        1.5,
        [
            ["BlockStored", ints, None, [1, 2, 3, 4], 2, None, "GPU", None],
            ["BlockRemoved", [ints[1]], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert all(0 <= x < 2**64 for x in ints) and ints == [external_hash(x) for x in h]
    assert msgpack.unpackb(encode_batch(2.0, [BlockStored(h[1:], h[0], [3, 4], 2)], 1, "array"))[1][0][2] == ints[0]


def test_the_map_encoding_is_vllms_tagged_maps():
    """The default: vLLM 0.24 and later decode events as maps (msgspec structs without ``array_like``)."""
    h = hash_page(None, [1, 2])
    batch = msgpack.unpackb(encode_batch(3.0, [BlockStored([h], None, [1, 2], 2), BlockRemoved([h])], 2))
    stored, removed = batch[1]
    assert batch[0] == 3.0 and batch[2] == 2
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [external_hash(h)],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert removed == {"type": "BlockRemoved", "block_hashes": [external_hash(h)], "medium": "GPU", "group_idx": 0}


def test_config_is_vllms_json():
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}')
    assert cfg.enabled and cfg.endpoint == "tcp://*:5557" and cfg.topic == "kv" and cfg.encoding == "map"
    assert KVEventsConfig.parse({"enable_kv_cache_events": True}).enabled  # zmq by default, as vLLM
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert not KVEventsConfig.parse("{}").enabled and KVEventsConfig.parse(None) is None
    for bad, word in [
        ('{"enable_kv_cache_events": true, "port": 1}', "port"),
        ('{"publisher": "kafka"}', "kafka"),
        ('{"encoding": "json"}', "json"),
        ("[1]", "object"),
        ("{", "JSON"),
    ]:
        with pytest.raises(ValueError, match=word):
            KVEventsConfig.parse(bad)


# ---------------------------------------------------------------------------------------------------- publisher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subscriber(ctx, topic=b""):
    zmq = pytest.importorskip("zmq")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    return sub


def joined(pub, sub, timeout=10.0):
    """Publishes empty batches until ``sub`` receives one (a PUB socket drops what it sends before a subscriber
    has joined); returns the last sequence number received, once nothing more is pending."""
    deadline = time.monotonic() + timeout
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the subscriber never joined"
        pub.publish([])
    seq = None
    while sub.poll(200):
        topic, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
    return seq


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_publisher_frames_numbers_and_replays_batches(tmp_path, encoding):
    """Live: [topic, seq, payload]. Replay: vLLM 0.26 and later answer [b"", topic, seq, payload] and end with
    [b"", b"", -1, b""]; up to 0.25 (the "array" consumers) without the topic frame."""
    zmq = pytest.importorskip("zmq")
    from jaxserve.core.kv_events import make_publisher

    ctx, port = zmq.Context.instance(), free_port()
    endpoint = f"ipc://{tmp_path}/kv.sock"  # ipc: the publisher binds it (vLLM's rule), the subscriber connects
    pub = make_publisher(
        {
            "enable_kv_cache_events": True,
            "endpoint": endpoint,
            "replay_endpoint": f"tcp://127.0.0.1:{port}",
            "topic": "kv",
            "encoding": encoding,
        }
    ).start()
    sub = _subscriber(ctx, b"kv")
    sub.connect(endpoint)
    try:
        last = joined(pub, sub)
        h = hash_page(None, [1, 2])
        pub.publish([BlockStored([h], None, [1, 2], 2)], data_parallel_rank=1)
        pub.publish([BlockRemoved([h])])
        frames = [sub.recv_multipart() for _ in range(2)] if sub.poll(5000) else []
        assert [f[0] for f in frames] == [b"kv", b"kv"]
        assert [int.from_bytes(f[1], "big") for f in frames] == [last + 1, last + 2]  # 8 bytes, big-endian
        assert all(len(f[1]) == 8 for f in frames)
        (ts, stored, rank), (_, removed, _) = (msgpack.unpackb(f[2]) for f in frames)
        assert abs(ts - time.time()) < 60 and rank == 1
        assert stored == [msgpack.unpackb(encode_batch(0, [BlockStored([h], None, [1, 2], 2)], 1, encoding))[1][0]]
        assert removed == [msgpack.unpackb(encode_batch(0, [BlockRemoved([h])], 0, encoding))[1][0]]
        assert stored[0]["type" if encoding == "map" else 0] == "BlockStored"

        dealer = ctx.socket(zmq.DEALER)  # replay from 0: the startup AllBlocksCleared first, then the rest
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(5000):
            empty, *topic, seq, payload = dealer.recv_multipart()
            assert empty == b"" and len(topic) == (1 if encoding == "map" else 0)
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b"" and topic in ([b""], [])
                break
            assert topic in ([b"kv"], [])
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
        dealer.close()
        assert [seq for seq, _ in replayed] == list(range(last + 3))
        cleared = {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]
        assert replayed[0][1] == [cleared] and replayed[-1][1] == removed
    finally:
        sub.close()
        pub.close()


def test_publisher_that_cannot_bind_fails_at_start(tmp_path):
    zmq = pytest.importorskip("zmq")
    from jaxserve.core.kv_events import make_publisher

    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv.sock"}
        pub = make_publisher({**config, "replay_endpoint": f"tcp://127.0.0.1:{port}"})
        with pytest.raises(RuntimeError, match="Address already in use"):
            pub.start()
    finally:
        taken.close(linger=0)
    assert make_publisher({"enable_kv_cache_events": False}) is None and make_publisher(None) is None


# ---------------------------------------------------------------------------------------------------- served
def test_a_served_request_publishes_its_pages_and_their_eviction():
    """A real SUB socket on a loopback port (the server connects to it, vLLM's rule for an address without ``*``)
    sees BlockStored for the pages of a request, with the block manager's hashes, and BlockRemoved when the next
    request evicts them (SchedulerEngine: the real scheduler and block manager; 8 pages of 4 tokens)."""
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from helpers import SchedulerEngine

    from jaxserve.server.app import build_app

    sub = _subscriber(zmq.Context.instance(), b"kv-events")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    engine = SchedulerEngine(num_pages=9, page_size=4)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv-events"}
    app = build_app(engine, kv_events=json.dumps(config))
    bm = engine.scheduler.block_manager
    stored, removed, batches = [], [], []

    def receive(done):
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, (stored, removed)
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                ts, events, rank = msgpack.unpackb(payload)
                batches.append(int.from_bytes(seq, "big"))
                assert topic == b"kv-events" and rank == 0
                stored.extend(e for e in events if e["type"] == "BlockStored")
                removed.extend(e for e in events if e["type"] == "BlockRemoved")

    try:
        with TestClient(app) as client:
            last = joined(app.state.server.engine.kv_publisher, sub)
            prompt = "abcdefghij"
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6})
            assert r.status_code == 200
            # vLLM's int form of a hash, worked out here: the sha256's last 8 bytes, big-endian.
            first = {int.from_bytes(h[-8:], "big") for h in bm.hash_to_page}  # 15 tokens computed: 3 full pages
            assert len(first) == 3
            receive(lambda: {h for e in stored for h in e["block_hashes"]} == first)
            tokens = engine.tokenizer.encode(prompt) + [7] * 5
            assert [t for e in stored for t in e["token_ids"]] == tokens[:12]
            assert {e["block_size"] for e in stored} == {4}
            parent = None
            for e in stored:  # the chain: each event's parent is the previous event's last page
                assert e["parent_block_hash"] == parent
                assert (e["lora_id"], e["medium"], e["lora_name"]) == (None, "GPU", None)
                parent = e["block_hashes"][-1]

            r = client.post("/v1/completions", json={"prompt": "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "max_tokens": 6})
            assert r.status_code == 200  # 31 tokens computed: all 8 pages, so the first request's are evicted
            cached = {int.from_bytes(h[-8:], "big") for h in bm.hash_to_page}
            receive(
                lambda: (
                    {h for e in stored for h in e["block_hashes"]} - {h for e in removed for h in e["block_hashes"]}
                    == cached
                )
            )
        assert {h for e in removed for h in e["block_hashes"]} == first and all(e["medium"] == "GPU" for e in removed)
        assert batches == list(range(last + 1, last + 1 + len(batches)))  # no batch lost
    finally:
        sub.close()


def test_kv_events_need_pyzmq_and_msgpack(monkeypatch):
    from jaxserve.core.kv_events import check_dependencies, make_publisher

    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq raises ImportError
    with pytest.raises(ImportError, match=r"pyzmq: pip install 'jaxserve\[kv-events\]'"):
        check_dependencies()
    with pytest.raises(ImportError, match="pyzmq"):
        make_publisher({"enable_kv_cache_events": True})
    assert make_publisher({"enable_kv_cache_events": False}) is None  # off: nothing is imported


def test_serve_flag_takes_vllms_json(capsys):
    from jaxserve.cli import build_parser

    flag = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
    args = build_parser().parse_args(["serve", "--kv-events-config", flag])
    assert args.kv_events_config == KVEventsConfig(True, "zmq", "tcp://*:5557", topic="kv")
    assert build_parser().parse_args(["serve"]).kv_events_config is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-events-config", '{"enable": true}'])
    assert "unknown key(s) ['enable']" in capsys.readouterr().err
