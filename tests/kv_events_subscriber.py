"""A KV-cache event subscriber for the tests: vLLM's event structs (msgspec, array_like + tag,
as vLLM's publisher encoded them and llm-d's indexer decodes them) and a SUB socket.

Importable as `kv_events_subscriber` from any test module (tests/ is on sys.path)."""

from __future__ import annotations

import time

import msgspec
import zmq

from engine.block_manager import _ROOT_HASH, hash_block
from processes import free_port


# vLLM's event structs as its publisher encoded them (array_like + tag): what llm-d decodes too.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(VllmEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(VllmEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(VllmEvent):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def subscriber(topic: bytes = b"") -> tuple[zmq.Socket, str]:
    """A SUB socket bound on loopback; the engine's PUB connects to it (vLLM: a host address connects)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")
    return sub, f"tcp://127.0.0.1:{port}"


def settle(sub: zmq.Socket) -> None:
    """Let the engine's PUB connection in and the subscription out: a ZMQ socket handles its
    pending connections only inside calls on it (a SUB idle while the PUB connects sends its
    subscription with the first poll, and misses what is published meanwhile)."""
    assert not sub.poll(500)


def receive(sub: zmq.Socket, until, timeout_s: float = 20) -> list:
    """Decoded events until `until(events)` holds (or the timeout)."""
    events, deadline = [], time.monotonic() + timeout_s
    while not until(events) and time.monotonic() < deadline:
        if sub.poll(100):
            _topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            events.extend(DECODER.decode(payload).events)
    return events


def chain(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes, parent = [], _ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
