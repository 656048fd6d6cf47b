"""KV-cache events: which prefix blocks this replica holds, published for cache-aware routers.

The wire format is vLLM's (vllm/distributed/kv_events.py), which llm-d's kv-cache indexer and
Dynamo decode: a ZMQ PUB socket sends multipart messages [topic, seq, payload], where seq is
an 8-byte big-endian counter and payload is msgpack of an event batch

    [ts, [event, ...], data_parallel_rank]

and each event is an array whose first element is its tag (msgspec's
`Struct(array_like=True, tag=True)` encoding):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes go out as 64-bit unsigned integers: the last 8 bytes (big-endian) of Pagoda's
32-byte sha256 chain hash, which is what vLLM sends by default
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) and what llm-d's indexer reads.

The engine loop only appends a step's batch to a bounded queue (`publish` never blocks);
a thread encodes and sends. When the queue is full the batch is dropped and counted.
An optional ROUTER socket replays buffered batches from a sequence number (vLLM's protocol:
request [identity, b"", start_seq], replies [identity, b"", seq, payload]..., then seq -1
and an empty payload).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine.settings import json_object_setting

logger = logging.getLogger(__name__)

_KEYS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
         "max_queue_size", "topic")
PUBLISHERS = ("null", "zmq")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay stream's end marker (vLLM's)."""


@dataclass(slots=True)
class KVEventsConfig:
    """`--kv-events-config`, vLLM's keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, raw: str | dict | None) -> "KVEventsConfig | None":
        """The parsed settings; None when absent. Raises ValueError naming a bad key or value."""
        raw = json_object_setting(raw, "kv_events_config", _KEYS)
        if raw is None:
            return None
        config = cls(**raw)
        if not isinstance(config.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config: enable_kv_cache_events must be true or false")
        if config.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher must be one of {PUBLISHERS}, got {config.publisher!r}")
        # vLLM: enabling the events without naming a publisher means zmq.
        if config.enable_kv_cache_events and "publisher" not in raw:
            config.publisher = "zmq"
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(config, key), str):
                raise ValueError(f"kv_events_config: {key} must be a string")
        if config.replay_endpoint is not None and not isinstance(config.replay_endpoint, str):
            raise ValueError("kv_events_config: replay_endpoint must be a string or null")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {key} must be an integer >= 1, got {value!r}")
        if config.enabled:
            try:
                import msgpack  # noqa: F401
                import zmq  # noqa: F401
            except ImportError as e:
                raise ValueError(
                    f"kv_events_config: the zmq publisher needs pyzmq and msgpack ({e}); pip install 'pagoda[kv-events]'"
                ) from None
        return config


def external_hash(block_hash: bytes) -> int:
    """A chain hash as it goes on the wire: its last 8 bytes, big-endian (vLLM's int form)."""
    return int.from_bytes(block_hash[-8:], "big")


class ZmqEventPublisher:
    """PUB socket (+ optional ROUTER replay socket) fed from a bounded queue by one thread."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import msgpack
        import zmq

        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[list | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.num_dropped_batches = 0
        self.num_dropped_events = 0
        self.num_sent_batches = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = config.endpoint
        # vLLM's convention: a wildcard or ipc/inproc address binds, anything else connects.
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self._replay = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            raise ValueError(f"kv_events_config: cannot open {endpoint!r}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pagoda-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> bool:
        """Queue one step's events (encoded tuples, see `encode_event`); never blocks.
        False: the queue was full and the batch was dropped (counted)."""
        try:
            self._queue.put_nowait([time.time(), events, self._dp_rank])
            return True
        except queue.Full:
            self.num_dropped_batches += 1
            self.num_dropped_events += len(events)
            return False

    def shutdown(self) -> None:
        """Send what is queued (for at most a second), then close the sockets."""
        self._running = False
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT_S
        while True:
            try:
                self._queue.put(None, timeout=max(deadline - time.monotonic(), 0.001))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        import zmq

        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("kv events: replay request failed")
            # Reading EVENTS makes ZMQ process the socket's pending commands: new subscribers'
            # pipes and subscriptions take effect now, not at the next send (which they would miss).
            self._pub.getsockopt(zmq.EVENTS)
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            try:
                payload = self._pack(batch)
                # PUB never blocks: past the high-water mark ZMQ drops for that subscriber.
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_sent_batches += 1
                seq += 1
            except Exception:
                logger.exception("kv events: publishing failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def block_stored(hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
                 lora_id: int | None, medium: str) -> list[Any]:
    return ["BlockStored", [external_hash(h) for h in hashes],
            None if parent is None else external_hash(parent), token_ids, block_size, lora_id, medium, None]


def block_removed(hashes: list[bytes], medium: str) -> list[Any]:
    return ["BlockRemoved", [external_hash(h) for h in hashes], medium]


ALL_BLOCKS_CLEARED = ["AllBlocksCleared"]
