"""KV-cache events in vLLM's wire format, for prefix-aware routers (opt-in: ``--kv-events-config``).

The block manager records, when asked to (``BlockManager.enable_kv_events``), what enters and leaves its prefix
cache: ``BlockStored`` when full pages get their hashes registered, ``BlockRemoved`` when a cached page is evicted.
The serving loop drains those lists after every engine step and hands them to a ``ZmqEventPublisher``, which
sends each step's events of one replica as one batch, from its own thread, as vLLM's
``vllm/distributed/kv_events.py`` does:

* ZMQ multipart ``[topic, sequence number (8 bytes, big-endian), payload]`` on a PUB socket; the sequence
  numbers count batches from 0, so a subscriber sees a gap when it missed one;
* payload: msgpack of the batch ``[ts, events, data_parallel_rank]`` (``ts``: ``time.time()``);
* an event, in the ``"map"`` encoding (the default: vLLM 0.24 and later, whose event structs are msgspec maps
  tagged ``"type"``): ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"}``, ``{"type": "BlockRemoved",
  "block_hashes", "medium", "group_idx"}``, ``{"type": "AllBlocksCleared"}``; in the ``"array"`` encoding (vLLM up
  to 0.23, its structs ``array_like``) the first fields as a list after the tag,
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``. Checked by decoding this stream with the
  event classes of vLLM's own wheels, 0.23 to 0.34;
* block hashes as vLLM sends them by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): unsigned 64-bit
  integers, the last 8 bytes (big-endian) of the page's sha256 (``jaxserve.core.block_manager.hash_page``);
* an optional ROUTER replay socket: a request ``[b"", start_seq (8 bytes, big-endian)]`` is answered with every
  buffered batch from ``start_seq`` on, ``[b"", topic, seq, payload]`` each, then ``[b"", b"", -1 (8 bytes,
  signed), b""]`` (vLLM 0.26 and later); in the ``"array"`` encoding, as vLLM up to 0.25 answers,
  ``[b"", seq, payload]`` each, then ``[b"", -1, b""]``.

The publisher sends ``AllBlocksCleared`` when it starts (a restarted server holds no cached pages).

Host code: no jax; ``zmq`` and ``msgpack`` (the ``kv-events`` extra) are imported only by a publisher.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time

logger = logging.getLogger("jaxserve.core.kv_events")

MEDIUM = "GPU"  # vLLM's name for the accelerator's KV pool, whatever the accelerator
ENCODINGS = ("array", "map")
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------------------------------------------- events
@dataclasses.dataclass
class BlockStored:
    """Full pages whose hashes entered the prefix cache, in prefix order: ``block_hashes[i]`` covers
    ``token_ids[i * block_size : (i + 1) * block_size]``; ``parent_block_hash`` is the hash of the page before
    the first one (None: the first page of a sequence). Hashes are ``hash_page``'s sha256 digests."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclasses.dataclass
class BlockRemoved:
    """Cached pages evicted (their hashes left the prefix cache)."""

    block_hashes: list[bytes]


@dataclasses.dataclass
class AllBlocksCleared:
    """Every cached page is gone."""


def drain(block_managers) -> list[tuple[int, list]]:
    """The events each block manager recorded since the last drain, as ``(replica index, events)`` for the
    replicas that have any; their lists are emptied."""
    out = []
    for rank, bm in enumerate(block_managers):
        events = bm.drain_kv_events()
        if events:
            out.append((rank, events))
    return out


# ---------------------------------------------------------------------------------------------------- wire format
def external_hash(digest: bytes) -> int:
    """A page hash as vLLM sends it by default: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def _wire_event(event, encoding: str):
    if isinstance(event, BlockStored):
        hashes = [external_hash(h) for h in event.block_hashes]
        parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
        if encoding == "array":
            return ["BlockStored", hashes, parent, event.token_ids, event.block_size, None, MEDIUM, None]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        hashes = [external_hash(h) for h in event.block_hashes]
        if encoding == "array":
            return ["BlockRemoved", hashes, MEDIUM]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": 0}
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: list, data_parallel_rank: int = 0, encoding: str = "map") -> bytes:
    """One batch's payload: msgpack of ``[ts, events, data_parallel_rank]`` (module docstring)."""
    import msgpack

    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    return msgpack.packb([float(ts), [_wire_event(e, encoding) for e in events], data_parallel_rank])


# ---------------------------------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: vLLM's KVEventsConfig fields, plus ``encoding``.

    Args:
        enable_kv_cache_events: publish at all.
        publisher: ``"zmq"``, or ``"null"`` (publish nothing); None: ``"zmq"`` when enabled.
        endpoint: the PUB socket's address. With ``*`` or ``::`` in it, or an ``ipc://`` / ``inproc://`` one, the
            socket binds it; otherwise it connects to it (a subscriber that binds). vLLM's rule and default.
        replay_endpoint: a ROUTER address (bound) answering replay requests; None: no replay.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's send high-water mark (messages a slow subscriber may fall behind by).
        max_queue_size: batches waiting for the publisher thread beyond which new ones are dropped (their sequence
            numbers are skipped, so subscribers see the gap) rather than stall the engine.
        topic: the first frame of every message.
        encoding: ``"map"`` (vLLM 0.24 and later, and the consumers written for it) or ``"array"`` (vLLM up to
            0.23: events as arrays, and the replay framing without the topic).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"

    def __post_init__(self):
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv-events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv-events encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv-events {name} must be a positive int, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.enable_kv_cache_events) and self.publisher != "null"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """A config from itself, a dict or a JSON object string (``--kv-events-config``); None stays None.

        Raises:
            ValueError: not a JSON object, an unknown key (naming it), or a bad value.
        """
        from jaxserve.config import parse_json_config

        return parse_json_config(cls, value, "--kv-events-config")


def check_dependencies() -> None:
    """Raises ImportError, saying what to install, when pyzmq or msgpack is missing."""
    missing = []
    for module, package in (("zmq", "pyzmq"), ("msgpack", "msgpack")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise ImportError(
            f"KV-cache events (--kv-events-config) need {' and '.join(missing)}: pip install 'jaxserve[kv-events]'"
        )


# ---------------------------------------------------------------------------------------------------- publisher
def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes event batches on a ZMQ PUB socket from its own thread (module docstring for the format).

    ``publish`` only numbers a batch and queues it: encoding and sending happen in the thread, which owns the
    sockets (made there, so a bad endpoint fails ``start``).
    """

    def __init__(self, config: KVEventsConfig):
        check_dependencies()
        self.config = config
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque = collections.deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()  # next() is atomic: the engine thread and start() both publish
        self._topic = config.topic.encode()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.num_dropped = 0  # batches dropped because the queue was full

    def start(self, timeout: float = 10.0) -> ZmqEventPublisher:
        """Opens the sockets (in the publisher thread) and publishes ``AllBlocksCleared``.

        Raises:
            RuntimeError: a socket could not be opened (e.g. the endpoint's port is taken).
        """
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"KV-events publisher on {self.config.endpoint!r} failed: {self._error!r}")
        logger.info(
            "publishing KV-cache events on %s (%s), topic %r",
            self.config.endpoint,
            "bound" if _binds(self.config.endpoint) else "connected",
            self.config.topic,
        )
        self.publish([AllBlocksCleared()])
        return self

    def publish(self, events: list, data_parallel_rank: int = 0) -> None:
        """Queues one batch (non-blocking: when the queue is full the batch is dropped, its number skipped)."""
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, time.time(), events, data_parallel_rank))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                logger.warning("KV-events queue full (%d batches): dropping batches", self.config.max_queue_size)

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        import zmq

        cfg = self.config
        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(cfg.hwm)
            if _binds(cfg.endpoint):
                pub.bind(cfg.endpoint)
            else:
                pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(cfg.replay_endpoint)
        except Exception as e:  # noqa: BLE001 - start() raises it
            self._error = e
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    break
                seq, ts, events, rank = item
                try:
                    payload = encode_batch(ts, events, rank, cfg.encoding)
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                except Exception:  # noqa: BLE001 - one bad batch must not end the stream
                    logger.exception("KV-events batch %d was not sent", seq)
        finally:
            pub.close(linger=1000)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-events replay: a request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        topic = () if self.config.encoding == "array" else (self.config.topic.encode(),)  # vLLM <= 0.25: none
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", *topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", *(b"" for _ in topic), _END_SEQ, b""))


def make_publisher(config: KVEventsConfig | dict | str | None) -> ZmqEventPublisher | None:
    """A publisher for ``config`` (not started), or None when events are off.

    Raises:
        ValueError: a bad config. ImportError: pyzmq or msgpack is missing.
    """
    config = KVEventsConfig.parse(config)
    if config is None or not config.enabled:
        return None
    return ZmqEventPublisher(config)
