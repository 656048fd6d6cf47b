"""Rate limits (server/rate_limit.py) and the keys file (server/tenants.py) without a server:
a fake clock drives the buckets, so a minute's limits are checked in no time."""

import asyncio
import hashlib
import json

import pytest

from server.rate_limit import KeyLimiter, Limits, RateLimitExceeded, format_duration, retry_after_headers
from server.response_store import key_owner
from server.tenants import KeyRegistry, KeysFileError, parse_keys


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_bursts_then_refills_at_the_limits_pace():
    clock = Clock()
    limiter = KeyLimiter(Limits(requests_per_minute=60), clock)
    for _ in range(60):
        limiter.admit_request()
        limiter.release()
    with pytest.raises(RateLimitExceeded) as e:
        limiter.admit_request()
    assert e.value.kind == "requests" and e.value.retry_after_s == pytest.approx(1.0)
    headers = dict(limiter.headers())
    assert headers[b"x-ratelimit-limit-requests"] == b"60"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"1m0s"
    clock.t += 1.0
    limiter.admit_request()  # one more a second


def test_tokens_prompt_at_admission_completion_into_debt():
    clock = Clock()
    limiter = KeyLimiter(Limits(tokens_per_minute=600), clock)  # 10 a second
    limiter.admit_request()
    limiter.admit_tokens(500)
    limiter.charge_tokens(300)  # completion tokens are never refused: 200 in debt
    assert dict(limiter.headers())[b"x-ratelimit-remaining-tokens"] == b"0"
    with pytest.raises(RateLimitExceeded) as e:
        limiter.admit_request()  # in debt: refused before tokenizing
    assert e.value.kind == "tokens" and e.value.retry_after_s == pytest.approx(20.1)
    clock.t += 25
    limiter.admit_request()
    with pytest.raises(RateLimitExceeded) as e:
        limiter.admit_tokens(100)  # 50 in the bucket
    assert e.value.retry_after_s == pytest.approx(5.0)
    with pytest.raises(ValueError, match="more than this API key's tokens_per_minute"):
        limiter.admit_tokens(601)  # could never pass: not a 429


def test_concurrency_slots():
    limiter = KeyLimiter(Limits(max_concurrent_requests=2), Clock())
    limiter.admit_request()
    limiter.admit_request()
    with pytest.raises(RateLimitExceeded) as e:
        limiter.admit_request()
    assert e.value.kind == "concurrency"
    limiter.release()
    limiter.admit_request()
    assert limiter.headers() == []  # no per-minute limit: no x-ratelimit headers


def test_formats():
    assert [format_duration(s) for s in (0.0201, 1, 1.5, 360, 61.25)] == ["21ms", "1s", "1.5s", "6m0s", "1m1.25s"]
    assert retry_after_headers(0.2) == {"Retry-After": "1", "retry-after-ms": "200"}
    assert retry_after_headers(2.5) == {"Retry-After": "3", "retry-after-ms": "2500"}


def _entry(**kw):
    return {"name": "a", "key": "k", **kw}


@pytest.mark.parametrize("data,message", [
    ({"keys": []}, "non-empty list"),
    ({"key": []}, "one entry, 'keys'"),
    ({"keys": [_entry(name="bad name")]}, "'name' must be"),
    ({"keys": [_entry(), _entry(key="k2")]}, "the name is used twice"),
    ({"keys": [_entry(), _entry(name="b")]}, "the same key is listed twice"),
    ({"keys": [{"name": "a"}]}, "exactly one of 'key' and 'key_sha256'"),
    ({"keys": [{"name": "a", "key_sha256": "abc"}]}, "64 hex digits"),
    ({"keys": [_entry(tokens_per_minute=0)]}, "'tokens_per_minute' must be a positive integer"),
    ({"keys": [_entry(max_concurrent_requests=True)]}, "'max_concurrent_requests' must be a positive integer"),
    ({"keys": [_entry(priority=5000)]}, "'priority' must be an integer in"),
    ({"keys": [_entry(requests_per_min=5)]}, "unknown field(s) ['requests_per_min']"),
])
def test_malformed_keys_are_refused_with_where_and_why(data, message):
    with pytest.raises(KeysFileError) as e:
        parse_keys(data, "keys.yaml")
    assert message in str(e.value)
    assert "'k'" not in str(e.value) and "k2" not in str(e.value)  # never a key in a message


def test_registry_authenticates_reloads_and_keeps_old_keys_on_a_bad_file(tmp_path):
    path = tmp_path / "keys.json"
    digest = hashlib.sha256(b"hashed").hexdigest()
    path.write_text(json.dumps({"keys": [{"name": "a", "key": "key-a", "requests_per_minute": 5},
                                         {"name": "h", "key_sha256": digest, "priority": 3}]}))
    registry = KeyRegistry(path, api_key="single")
    assert registry.authenticate(b"key-a").name == "a"
    assert registry.authenticate(b"hashed").priority == 3
    assert registry.authenticate(b"single").name is None  # --api-key: no name, no limits
    assert registry.authenticate(b"key-") is None and registry.authenticate(b"") is None
    # The Responses store's owner id is key_owner(key), whichever way the key was given.
    assert registry.authenticate(b"hashed").owner == key_owner("hashed")
    limiter = registry.limiter(registry.authenticate(b"key-a"))
    limiter.admit_request()
    path.write_text("keys: [")  # malformed: the keys in force stay
    assert registry.reload() is False
    assert registry.authenticate(b"key-a") is not None
    path.write_text(json.dumps({"keys": [{"name": "a", "key": "key-a2", "requests_per_minute": 7}]}))
    assert registry.reload() is True
    assert registry.authenticate(b"key-a") is None and registry.authenticate(b"key-a2").name == "a"
    kept = registry.limiter(registry.authenticate(b"key-a2"))
    assert kept is limiter and kept.in_flight == 1  # same name: buckets and in-flight count carry over
    assert dict(kept.headers())[b"x-ratelimit-limit-requests"] == b"7"


def test_reload_off_the_loop_keeps_limiters_and_coalesces_signals(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps({"keys": [{"name": "a", "key": "key-a", "max_concurrent_requests": 4}]}))
    registry = KeyRegistry(path)
    limiter = registry.limiter(registry.authenticate(b"key-a"))
    limiter.admit_request(3)  # three samples in flight carry over the reload

    async def reload_twice() -> list[bool]:
        path.write_text(json.dumps({"keys": [{"name": "a", "key": "key-a", "max_concurrent_requests": 2},
                                             {"name": "b", "key": "key-b"}]}))
        first = asyncio.ensure_future(registry.reload_off_loop())
        await asyncio.sleep(0)  # the first is reading; a second signal only asks for one more pass
        return [await registry.reload_off_loop(), await first]

    assert asyncio.run(reload_twice()) == [False, True]
    assert registry.num_reloads == 2 and registry.names == ["a", "b"]
    kept = registry.limiter(registry.authenticate(b"key-a"))
    assert kept is limiter and kept.in_flight == 3 and kept.limits.max_concurrent_requests == 2
    with pytest.raises(RateLimitExceeded):
        kept.admit_request()
    with pytest.raises(ValueError, match="more than this API key's max_concurrent_requests"):
        kept.admit_request(3)
