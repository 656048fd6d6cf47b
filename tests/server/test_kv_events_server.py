"""KV-cache events from a real `pagoda serve`: a subscriber decodes them with vLLM's structs,
stored blocks chain like the prompt's hashes, evictions remove the same hashes, and a bad
--kv-events-config fails the start with one line."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import zmq
from kv_events_subscriber import DECODER, BlockRemoved, BlockStored, chain, settle

from engine.kv_events import external_hash
from processes import REPO_ROOT, Server, free_port, pagoda_command

BLOCK = 16
PROMPT_LEN = 96  # 6 full blocks each


@pytest.fixture(scope="module")
def events_server(tiny_model_path, tmp_path_factory):
    """A server whose PUB connects to this SUB (bound on loopback), with room for ~39 blocks:
    ten 6-block prompts evict the first ones."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    sub_port = free_port()
    sub.bind(f"tcp://127.0.0.1:{sub_port}")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{sub_port}"}
    server = Server("pagoda-kv-events", pagoda_command(
        "--model", str(tiny_model_path), "--max-model-len", "256", "--dtype", "float32",
        "--kv-cache-memory", "0.0003", "--kv-events-config", json.dumps(config),
    ), tmp_path_factory.mktemp("kv-events-logs"))
    try:
        server.wait_ready(120)
        settle(sub)
        yield server, sub, server.port
    finally:
        server.stop()
        sub.close()


def test_events_chain_the_prompt_and_evictions_remove_the_same_hashes(events_server, tiny_model_path):
    server, sub, port = events_server
    base = f"http://127.0.0.1:{port}"
    prompts = [[1000 + 100 * i + j for j in range(PROMPT_LEN)] for i in range(10)]
    for prompt in prompts:
        r = httpx.post(f"{base}/v1/completions", json={
            "model": tiny_model_path.name, "prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
    first = {external_hash(h) for h in chain(prompts[0], BLOCK)}
    topics, seqs, events = set(), [], []
    removed: set[int] = set()
    while not first <= removed and sub.poll(10_000):
        topic, seq, payload = sub.recv_multipart()
        topics.add(topic)
        seqs.append(int.from_bytes(seq, "big"))
        batch = DECODER.decode(payload).events
        events.extend(batch)
        removed.update(h for e in batch if isinstance(e, BlockRemoved) for h in e.block_hashes)
    assert topics == {f"kv@127.0.0.1:{port}@{tiny_model_path.name}".encode()}
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
    stored = [e for e in events if isinstance(e, BlockStored)]
    # Each prompt's blocks went out as one chain: hashes, parent links and token ids.
    for prompt, event in zip(prompts, stored):
        assert event.block_hashes == [external_hash(h) for h in chain(prompt, BLOCK)]
        assert event.parent_block_hash is None
        assert event.token_ids == prompt
        assert event.block_size == BLOCK
    assert len(stored) >= 7
    # The evictions: the least recently freed blocks first, so the first prompt's; every
    # removed hash is one that was stored.
    assert first <= removed
    assert removed <= {h for e in stored for h in e.block_hashes}
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert f'pagoda:kv_events_dropped_total{{model_name="{tiny_model_path.name}"}} 0.0' in metrics


def test_bad_config_fails_the_start():
    """Before the model loads, in one line (the other bad values: tests/engine/test_kv_events.py)."""
    config = '{"enable_kv_cache_events": true, "publisher": "kafka", "endpont": "tcp://*:5557"}'
    result = subprocess.run(pagoda_command("--kv-events-config", config, port=free_port()), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "pagoda: error: kv_events_config: unsupported key(s) ['endpont']" in result.stderr
