"""Named API keys (`--api-keys-file`): who is calling, what they may use, how urgent they are.

The file (YAML, or JSON, which YAML reads too; `configs/api-keys/example.yaml`):

    keys:
      - name: team-a              # in logs and metrics; the key itself never is
        key_sha256: "9f86d0..."   # sha256 of the key, hex; or `key: "plain text"` (tests, demos)
        requests_per_minute: 600  # each limit optional (server/rate_limit.py)
        tokens_per_minute: 200000
        max_concurrent_requests: 32
        priority: 0               # lower is scheduled first; the most urgent a request may ask for

`KeyRegistry` holds the keys and each key's `KeyLimiter`. `authenticate` hashes the
presented key and compares the digest with every known digest (`hmac.compare_digest`,
no early exit), so the time taken does not tell which key, or how much of one, matched.
`reload()` reads the file again and swaps the keys at once; on SIGHUP `reload_off_loop()`
does, reading and parsing on a worker thread so that the event loop is never held up by a
large file. Requests in flight keep the key they were admitted with. A malformed file at
start-up raises `KeysFileError`; at reload it is logged and the keys in force stay.

The `--api-key` key, if any, is one more key without a name (tenant None: no limits, no
per-key series, as before named keys existed). A key's owner id, which the Responses
store files stored responses under (server/response_store.py), is derived from the key's
digest exactly as `key_owner` derives it from a plain key, so moving a key from
`--api-key` to the file keeps its stored responses visible.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import json
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from server.rate_limit import KeyLimiter, Limits

logger = logging.getLogger("pagoda.server")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
"""Key names: they become Prometheus label values and log words."""
PRIORITY_RANGE = (-1000, 1000)
"""Priorities a key (and a request) may have; lower is more urgent."""
TENANT_QUEUE_RESERVE = 0.25
"""The part of the queue bound (--max-waiting-requests, in samples) that one named key cannot
take: however much one key sends, the others' requests are still admitted."""
_FIELDS = {"name", "key", "key_sha256", "requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
           "priority"}
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


TENANT_STATE = "api_key_tenant"
"""The key in the ASGI scope's state where the auth middleware puts the caller's `Tenant`."""
LIMITER_STATE = "api_key_limiter"
"""... and that key's `KeyLimiter` (None: no limits)."""


def request_tenant(scope_state: dict) -> "tuple[Tenant | None, KeyLimiter | None]":
    """The caller's key and its limiter, from the ASGI scope's state (None, None without keys)."""
    return scope_state.get(TENANT_STATE), scope_state.get(LIMITER_STATE)


class KeysFileError(ValueError):
    """The keys file cannot be used; the message says where and why (never a key)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """One key: its name (None for `--api-key`), the sha256 of its text, its limits and priority."""

    name: str | None
    digest: bytes = field(repr=False)  # not key material, but no reason to print it either
    limits: Limits = Limits()
    priority: int = 0

    @property
    def owner(self) -> str:
        """The Responses store's owner id: `key_owner(key)` without the key."""
        return "key-" + self.digest.hex()[:32]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(data: Any, source: str) -> list[Tenant]:
    """The keys of a parsed keys file; KeysFileError naming the entry and field at fault."""
    if not isinstance(data, dict) or set(data) != {"keys"}:
        raise KeysFileError(f"{source}: expected a mapping with one entry, 'keys' (a list)")
    entries = data["keys"]
    if not isinstance(entries, list) or not entries:
        raise KeysFileError(f"{source}: 'keys' must be a non-empty list")
    tenants: list[Tenant] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for i, entry in enumerate(entries):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where}: expected a mapping")
        unknown = sorted(set(map(str, entry)) - _FIELDS)
        if unknown:
            raise KeysFileError(f"{where}: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise KeysFileError(f"{where}: 'name' must be 1-64 characters of letters, digits, '_', '.', ':', '-' "
                                f"(starting with a letter or digit), got {name!r}")
        where = f"{source}: keys[{i}] ({name})"
        if name in names:
            raise KeysFileError(f"{where}: the name is used twice")
        names.add(name)
        if ("key" in entry) == ("key_sha256" in entry):
            raise KeysFileError(f"{where}: give exactly one of 'key' and 'key_sha256'")
        if "key" in entry:
            key = entry["key"]
            if not isinstance(key, str) or not key.strip() or key != key.strip():
                raise KeysFileError(f"{where}: 'key' must be a non-empty string without surrounding spaces")
            digest = _digest(key)
        else:
            hexdigest = entry["key_sha256"]
            if not isinstance(hexdigest, str) or not _SHA256_HEX.fullmatch(hexdigest):
                raise KeysFileError(f"{where}: 'key_sha256' must be 64 hex digits (sha256sum of the key)")
            digest = bytes.fromhex(hexdigest)
        if digest in digests:
            raise KeysFileError(f"{where}: the same key is listed twice")
        digests.add(digest)

        def positive(field: str) -> int | None:
            value = entry.get(field)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KeysFileError(f"{where}: '{field}' must be a positive integer, got {value!r}")
            return value

        limits = Limits(positive("requests_per_minute"), positive("tokens_per_minute"),
                        positive("max_concurrent_requests"))
        priority = entry.get("priority", 0)
        low, high = PRIORITY_RANGE
        if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
            raise KeysFileError(f"{where}: 'priority' must be an integer in [{low}, {high}], got {priority!r}")
        tenants.append(Tenant(name, digest, limits, priority))
    return tenants


@contextmanager
def _gc_paused():
    """No garbage collection while a reload builds its objects: the hundreds of thousands
    that parsing tens of thousands of keys allocates set off full collections of the whole
    heap, which stop every thread, the event loop's included, for up to a second each."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _some(names: set[str], shown: int = 20) -> str:
    """Names for a log line: the first `shown` in order, then how many more."""
    if not names:
        return "none"
    listed = sorted(names)
    more = f" and {len(listed) - shown} more" if len(listed) > shown else ""
    return ", ".join(listed[:shown]) + more


def load_keys_file(path: str | Path) -> list[Tenant]:
    """Read and check the keys file (JSON by a .json suffix, else YAML)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise KeysFileError(f"{path}: cannot read the keys file: {e.strerror or e}") from None
    try:
        # libyaml's loader where PyYAML has it: the same safe subset, parsed ~7x faster.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.load(text, Loader=loader)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        # The parser's message quotes the offending line, which may hold a key: position only.
        mark = getattr(e, "problem_mark", None)
        line = getattr(e, "lineno", None) or (mark.line + 1 if mark is not None else "?")
        raise KeysFileError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'} "
                            f"(near line {line})") from None
    return parse_keys(data, str(path))


class KeyRegistry:
    """The keys in force (the file's and `--api-key`'s) and each named key's limiter."""

    def __init__(self, keys_file: str | Path | None = None, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_reload: Callable[[list[Tenant]], None] | None = None) -> None:
        self.path = Path(keys_file) if keys_file else None
        self._extra = [Tenant(None, _digest(api_key))] if api_key else []
        self._clock = clock
        self._limiters: dict[str, KeyLimiter] = {}
        self._tenants: list[Tenant] = []
        self.on_reload = on_reload
        self.num_reloads = 0
        self.num_failed_reloads = 0
        self._reloading = False
        self._reload_again = False
        self._reload_tasks: set[asyncio.Task] = set()
        self._install(load_keys_file(self.path) if self.path else [])

    @property
    def enabled(self) -> bool:
        """Whether any key is required at all."""
        return bool(self._tenants)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._tenants if t.name is not None]

    def _install(self, named: list[Tenant]) -> None:
        self._swap(named, *self._prepare(named))
        if self.on_reload is not None:
            self.on_reload(named)

    def _prepare(self, named: list[Tenant]) -> tuple[dict[str, KeyLimiter], list[tuple[KeyLimiter, Limits]]]:
        """The limiters of `named` (any thread; reloads are one at a time, so the limiters
        read here are still those in force at `_swap`): a new key gets a fresh one, a kept
        key its own, which keeps its buckets and in-flight count (with its new limits, if
        they changed, to put in force at `_swap`). A removed key's in-flight requests hold
        their limiter object, so they finish normally."""
        if any(t.name is None for t in named):
            raise AssertionError("file keys have names")
        limiters: dict[str, KeyLimiter] = {}
        changed: list[tuple[KeyLimiter, Limits]] = []
        for tenant in named:
            limiter = self._limiters.get(tenant.name)
            if limiter is None:
                limiter = KeyLimiter(tenant.limits, self._clock)
            elif limiter.limits != tenant.limits:
                changed.append((limiter, tenant.limits))
            limiters[tenant.name] = limiter
        return limiters, changed

    def _swap(self, named: list[Tenant], limiters: dict[str, KeyLimiter],
              changed: list[tuple[KeyLimiter, Limits]]) -> None:
        """Put `named` in force at once (on the event loop, where the limiters are used)."""
        for limiter, limits in changed:
            limiter.update(limits)
        self._limiters = limiters
        self._tenants = self._extra + named

    def reload(self) -> bool:
        """Read the keys file again and put it in force; on any error keep the keys in
        force and log why. True when the new keys are in force."""
        if self.path is None:
            return False
        try:
            named = load_keys_file(self.path)
        except KeysFileError as e:
            return self._reload_failed(e)
        before = set(self.names)
        self._install(named)
        return self._reloaded(before)

    async def reload_off_loop(self) -> bool:
        """`reload` as SIGHUP runs it: the file is read, parsed and checked on a worker thread
        (tens of thousands of keys take seconds of YAML parsing, during which the event loop
        goes on serving), then put in force in one step on the loop. SIGHUPs that arrive
        during a reload make one more reload after it, not one each."""
        if self.path is None:
            return False
        if self._reloading:
            self._reload_again = True
            return False
        self._reloading = True
        try:
            while True:
                self._reload_again = False
                try:
                    named, prepared = await asyncio.to_thread(self._read_and_prepare)
                except KeysFileError as e:
                    ok = self._reload_failed(e)
                else:
                    before = set(self.names)
                    self._swap(named, *prepared)
                    if self.on_reload is not None:
                        await asyncio.to_thread(self._announce, named)  # metrics' label sets: thread-safe
                    ok = self._reloaded(before)
                if not self._reload_again:
                    return ok
        finally:
            self._reloading = False

    def schedule_reload(self) -> None:
        """The SIGHUP handler: start `reload_off_loop` (the task is kept until it ends)."""
        task = asyncio.get_running_loop().create_task(self.reload_off_loop())
        self._reload_tasks.add(task)
        task.add_done_callback(self._reload_tasks.discard)

    def _read_and_prepare(self):
        with _gc_paused():
            named = load_keys_file(self.path)
            return named, self._prepare(named)

    def _announce(self, named: list[Tenant]) -> None:
        with _gc_paused():
            self.on_reload(named)

    def _reload_failed(self, error: KeysFileError) -> bool:
        self.num_failed_reloads += 1
        logger.error("API keys file not reloaded, the %d keys in force stay: %s", len(self.names), error)
        return False

    def _reloaded(self, before: set[str]) -> bool:
        self.num_reloads += 1
        after = set(self.names)
        logger.warning("API keys file reloaded: %d keys (added: %s; removed: %s)", len(after),
                       _some(after - before), _some(before - after))
        return True

    def authenticate(self, presented: bytes) -> Tenant | None:
        """The key whose text is `presented`, or None. Every known digest is compared, in
        constant time each, so neither which key matched nor a near miss shows in the time."""
        digest = hashlib.sha256(presented).digest()
        found = None
        for tenant in self._tenants:
            if hmac.compare_digest(digest, tenant.digest):
                found = tenant
        return found

    def limiter(self, tenant: Tenant) -> KeyLimiter | None:
        """The named key's limiter when it has any limit (None for `--api-key` or no limits)."""
        if tenant.name is None or not tenant.limits.any:
            return None
        return self._limiters.get(tenant.name)
