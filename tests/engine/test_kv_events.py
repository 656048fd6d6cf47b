"""KV-cache events (engine/kv_events.py): the wire format vLLM's structs decode, a cache reset,
the replay socket, and a publisher that never blocks the engine when nobody reads."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq
from kv_events_subscriber import DECODER, AllBlocksCleared, BlockStored, chain, receive, settle, subscriber

from engine import LLM, SamplingParams
from engine.engine_core import StepFailedError
from engine.kv_events import KVEventsConfig, ZmqEventPublisher, external_hash
from processes import free_port


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="unsupported key.*'endpiont'"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpiont": "tcp://*:5557"}')
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="hwm must be an integer"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "hwm": 0})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVEventsConfig.parse("{enable")
    assert KVEventsConfig.parse({"enable_kv_cache_events": True}).publisher == "zmq"
    assert not KVEventsConfig.parse({"enable_kv_cache_events": False, "publisher": "zmq"}).enabled


def test_engine_events_chain_and_cache_reset(tiny_model_path, monkeypatch):
    """Stored blocks chain like the prompt's own hashes; a failed step resets the prefix
    cache, which goes out as AllBlocksCleared."""
    sub, endpoint = subscriber()
    monkeypatch.setenv("PAGODA_FAULT_AT_STEP", "2")
    llm = LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=64,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "t"})
    try:
        settle(sub)
        core = llm.engine_core
        prompt = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        core.add_request("a", prompt, params)
        core.step()  # the prefill: "a" stores its 3 full blocks and finishes
        core.add_request("b", [7] * 40, params)
        with pytest.raises(StepFailedError):
            core.step()
        events = receive(sub, lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
    finally:
        llm.engine_core.shutdown()
        sub.close()
    # "a": its 3 full blocks; "b": its 2, registered when scheduled, before its step failed.
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [[external_hash(h) for h in chain(prompt, 16)], [external_hash(h) for h in chain([7] * 40, 16)]] == [
        e.block_hashes for e in stored]
    assert [e.parent_block_hash for e in stored] == [None, None]
    assert all(e.block_size == 16 and e.medium == "CPU" and e.lora_id is None for e in stored)
    assert [e.token_ids for e in stored] == [prompt[:48], [7] * 32]
    assert isinstance(events[-1], AllBlocksCleared)


def test_replay_resends_from_a_sequence_number():
    """vLLM's replay protocol: [b"", start seq] to the ROUTER; back come [b"", seq, payload]
    for each buffered batch from there, then seq -1 with an empty payload."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=replay, buffer_steps=3))
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(5):
            publisher.publish([["BlockRemoved", [i], "CPU"]])
        deadline = time.monotonic() + 10
        while publisher.num_sent_batches < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        client.connect(replay)
        client.send_multipart((b"", (1).to_bytes(8, "big")))  # the buffer holds the last 3 (2, 3, 4)
        replies = []
        while True:
            assert client.poll(10_000), "no replay answer"
            empty, seq, payload = client.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                break
            replies.append((seq, DECODER.decode(payload).events[0].block_hashes))
        assert replies == [(2, [2]), (3, [3]), (4, [4])]
    finally:
        client.close()
        publisher.shutdown()


def test_burst_with_a_stalled_subscriber_never_blocks_and_counts_drops():
    """10,000 batches into a small queue with a subscriber that never reads (hwm 1): every
    publish returns at once; what the queue cannot take is dropped and counted."""
    sub, endpoint = subscriber()
    sub.setsockopt(zmq.RCVHWM, 1)
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, hwm=1, max_queue_size=8))
    done = threading.Event()
    accepted = []

    def burst():
        accepted.append(sum(publisher.publish([["BlockRemoved", [i], "CPU"]]) for i in range(10_000)))
        done.set()

    try:
        thread = threading.Thread(target=burst, daemon=True)
        thread.start()
        assert done.wait(60), "publish blocked"
        assert publisher.num_dropped_batches > 0
        assert publisher.num_dropped_events == publisher.num_dropped_batches == 10_000 - accepted[0]
    finally:
        publisher.shutdown()
        sub.close()


def test_step_stats_drops_reach_the_metric():
    from engine.stats import StepStats
    from server.metrics import Metrics

    metrics = Metrics("m")
    metrics.on_step(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, kv_cache_tail_waste_tokens=0,
                              num_scheduled_tokens=0, kv_events_dropped=7))
    text = metrics.render()[0].decode()
    assert 'pagoda:kv_events_dropped_total{model_name="m"} 7.0' in text


def test_raw_message_frames():
    """What a subscriber outside Python sees: [topic, seq (8 bytes), msgpack [ts, [[tag, ...]], rank]]."""
    sub, endpoint = subscriber()
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv@h:1@m"))
    try:
        settle(sub)
        publisher.publish([["AllBlocksCleared"], ["BlockRemoved", [2**64 - 1], "CPU"]])
        assert sub.poll(10_000)
        topic, seq, payload = sub.recv_multipart()
    finally:
        publisher.shutdown()
        sub.close()
    assert (topic, seq) == (b"kv@h:1@m", bytes(8))
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    assert events == [["AllBlocksCleared"], ["BlockRemoved", [2**64 - 1], "CPU"]]
