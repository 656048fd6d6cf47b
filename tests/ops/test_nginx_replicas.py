"""Two real `pagoda serve` replicas behind a real nginx running configs/nginx/pagoda.conf.

nginx is Debian's `nginx` package (.ci/run installs it where apt-get works). The shipped file
is used as it is, with only its two replica addresses and its `listen` port replaced, inside
a small main config that runs nginx in the foreground with everything (pid, logs, temp files)
under a temporary prefix. Its access log records, per request, the test's request id and
every replica nginx tried (`$upstream_addr`, `$upstream_status`), which is how the test
tells retries apart. Both replicas serve the bundled model with a small batch and KV budget.

What a client of the proxy would notice, asserted here: requests spread over both replicas
and all succeed; requests with the same `x-session-id` all land on one replica; when a
replica is killed mid-run, every request started after the kill succeeds (a connection
refused is retried on the other replica), every non-streamed request succeeds even if it was
running on the killed replica (not yet answered, so retried), and the only requests allowed
to fail are streams that were already sending tokens from the killed replica; nginx stops
trying that replica after `max_fails`; with no replica left, nginx answers in the OpenAI
error envelope.
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from processes import REPO_ROOT, Server, free_port, pagoda_command

NGINX_CONF = REPO_ROOT / "configs" / "nginx" / "pagoda.conf"
K8S_YAML = REPO_ROOT / "configs" / "k8s" / "pagoda.yaml"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
NOT_INSTALLED = (
    "nginx is not installed (Debian package `nginx`: apt-get install nginx; .ci/run installs it"
    " when apt-get works)"
)
needs_nginx = pytest.mark.skipif(NGINX is None, reason=NOT_INSTALLED)

# What the shipped file says, and the test replaces.
SHIPPED_REPLICAS = ("127.0.0.1:8001", "127.0.0.1:8002")
SHIPPED_LISTEN = "listen 8000;"
STARTUP_TIMEOUT_S = 180.0
MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn"]


class Replica(Server):
    def __init__(self, name: str, log_dir: Path) -> None:
        super().__init__(name, pagoda_command(
            "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory", "0.1",
            "--no-access-log",
        # Two replicas share the machine's cores: one thread each, not two competing OpenMP teams.
        ), log_dir, env={"OMP_NUM_THREADS": "1"})
        self.addr = f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """A series summed over its label sets, from this replica's own /metrics."""
        r = httpx.get(f"{self.url}/metrics", timeout=10)
        assert r.status_code == 200, r.text
        return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples if s.name == name)

    def num_finished(self) -> float:
        return self.metric("pagoda:request_success_total")


# ---- the shipped config, rendered ---------------------------------------------------------------------


def upstream_params(text: str) -> tuple[int, int]:
    """(max_fails, fail_timeout seconds) of the shipped replicas' `server` lines."""
    found = set(re.findall(r"server\s+\S+\s+max_fails=(\d+)\s+fail_timeout=(\d+)s;", text))
    assert len(found) == 1, f"every replica should have the same max_fails/fail_timeout: {found}"
    (max_fails, fail_timeout), = found
    return int(max_fails), int(fail_timeout)


def render_site(replica_addrs: list[str], listen: str) -> str:
    """configs/nginx/pagoda.conf with the test's replicas and port, and nothing else changed."""
    text = NGINX_CONF.read_text()
    for shipped, addr in zip(SHIPPED_REPLICAS, replica_addrs, strict=True):
        # each replica is listed in both upstream groups (least_conn and by session)
        assert text.count(f"server {shipped} ") == 2, f"{shipped} should appear in both upstreams of {NGINX_CONF}"
        text = text.replace(f"server {shipped} ", f"server {addr} ")
    assert text.count(SHIPPED_LISTEN) == 1, f"{NGINX_CONF} should have one `{SHIPPED_LISTEN}`"
    return text.replace(SHIPPED_LISTEN, f"listen {listen};")


def main_conf(work: Path, site: Path) -> str:
    """A main nginx.conf that runs in the foreground with every path under `work`, no root needed."""
    # Started as root, nginx would run its workers as `nobody`, who cannot enter pytest's
    # private temp dirs: keep them as the user running the tests.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
    kinds = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    temp_paths = "\n".join(f"    {kind}_temp_path {work / kind};" for kind in kinds)
    return f"""{user}
daemon off;
worker_processes 2;
pid {work / 'nginx.pid'};
error_log {work / 'error.log'} notice;
events {{ worker_connections 512; }}
http {{
    log_format replicas escape=json '{{"id": "$http_x_test_request", "status": "$status",'
                                    ' "upstream_addr": "$upstream_addr", "upstream_status": "$upstream_status"}}';
    access_log {work / 'access.log'} replicas;
{temp_paths}
    include {site};
}}
"""


def write_nginx_conf(work: Path, replica_addrs: list[str], listen: str) -> Path:
    site = work / "pagoda.conf"
    site.write_text(render_site(replica_addrs, listen))
    conf = work / "nginx.conf"
    conf.write_text(main_conf(work, site))
    return conf


def nginx_args(work: Path, conf: Path, *extra: str) -> list[str]:
    # -e: the log nginx writes before it has read error_log (default: /var/log/nginx, not ours)
    return [NGINX, "-p", f"{work}/", "-e", str(work / "startup.log"), "-c", str(conf), *extra]


@needs_nginx
def test_shipped_config_passes_nginx_t_as_it_is(tmp_path):
    """The file users copy into conf.d is valid nginx, unedited."""
    conf = tmp_path / "nginx.conf"
    conf.write_text(main_conf(tmp_path, NGINX_CONF))
    run = subprocess.run(nginx_args(tmp_path, conf, "-t"), capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr


# ---- the Kubernetes example ---------------------------------------------------------------------


def k8s_objects() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(K8S_YAML.read_text())}


def test_k8s_probes_use_health_on_the_serving_port():
    objects = k8s_objects()
    assert sorted(objects) == ["Deployment", "Service"]
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert args[args.index("--port") + 1] == str(ports["http"])
    assert args[args.index("--host") + 1] == "0.0.0.0", "on the pod's loopback no probe or Service reaches it"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # readiness reacts before liveness restarts: out of the Service first
    ready, live = container["readinessProbe"], container["livenessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] < live["periodSeconds"] * live["failureThreshold"]
    # the preset it runs exists
    assert (REPO_ROOT / "configs" / f"{args[args.index('--config') + 1]}.yaml").exists()


def test_k8s_one_gpu_per_pod_and_service_reaches_the_pods():
    objects = k8s_objects()
    deployment, service = objects["Deployment"], objects["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    selector = service["spec"]["selector"]
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert selector.items() <= pod["metadata"]["labels"].items()
    port_names = {p["name"] for p in container["ports"]}
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    mounts = {m["name"] for m in container["volumeMounts"]}
    assert mounts == {v["name"] for v in pod["spec"]["volumes"]}


# ---- two replicas and nginx ---------------------------------------------------------------------


@dataclass
class Proxy:
    url: str
    work: Path
    process: Server
    replicas: list[Replica]
    max_fails: int
    fail_timeout_s: int

    def access_log(self, wait_for: list[str] = (), timeout_s: float = 10.0) -> dict[str, dict]:
        """Test request id -> what nginx logged for it (requests sent without an id left out).

        nginx writes a request's line in its log phase, after the response has reached the
        client, so a request just answered may not be there yet (seen with the suite's two
        workers busy): the file is read again, up to `timeout_s`, until every id in
        `wait_for` is in it."""
        deadline = time.monotonic() + timeout_s
        while True:
            entries = {}
            for line in (self.work / "access.log").read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line being written as we read: the next read has it
                    continue
                if entry["id"]:
                    entry["upstreams"] = [a.strip() for a in entry["upstream_addr"].split(",") if a.strip()]
                    entries[entry["id"]] = entry
            if set(wait_for) <= entries.keys() or time.monotonic() > deadline:
                return entries
            time.sleep(0.05)

    def error_log(self) -> str:
        return (self.work / "error.log").read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        # max_retries=0: a client-side retry would hide a request that failed at the proxy
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=60)

    def logs(self) -> str:
        return "\n".join([self.process.tail(), f"--- nginx error.log ---\n{self.error_log()[-4000:]}"]
                         + [r.tail(2000) for r in self.replicas])


@pytest.fixture(scope="module")
def proxy(default_model_path, tmp_path_factory):
    if NGINX is None:
        pytest.skip(NOT_INSTALLED)
    work = tmp_path_factory.mktemp("nginx")
    # Both replicas load at once (a few seconds each on two cores).
    replicas = [Replica("replica-a", work), Replica("replica-b", work)]
    nginx = None
    try:
        for replica in replicas:
            replica.wait_ready(STARTUP_TIMEOUT_S)
        port = free_port()
        conf = write_nginx_conf(work, [r.addr for r in replicas], f"127.0.0.1:{port}")
        nginx = Server("nginx", nginx_args(work, conf), work, port=port)
        nginx.wait_ready(30)
        max_fails, fail_timeout = upstream_params(NGINX_CONF.read_text())
        yield Proxy(nginx.url, work, nginx, replicas, max_fails, fail_timeout)
    finally:
        if nginx is not None:
            nginx.stop()
        for replica in replicas:
            replica.stop()


@pytest.fixture(scope="module")
def model_name(proxy) -> str:
    r = httpx.get(f"{proxy.url}/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


@dataclass
class Outcome:
    request_id: str
    stream: bool
    started: float
    ended: float
    text: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


_request_ids = itertools.count()


def complete(client: openai.OpenAI, model: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS,
             headers: dict | None = None) -> Outcome:
    """One greedy completion through the proxy; any error or short answer is recorded, not raised."""
    request_id = f"r{next(_request_ids)}"
    outcome = Outcome(request_id, stream, time.monotonic(), 0.0)
    kwargs = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True}, extra_headers={"x-test-request": request_id, **(headers or {})})
    try:
        if stream:
            text, finish, usage = "", None, None
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
        else:
            result = client.completions.create(**kwargs)
            text, finish, usage = result.choices[0].text, result.choices[0].finish_reason, result.usage
        if finish != "length" or usage is None or usage.completion_tokens != max_tokens:
            outcome.error = f"incomplete: finish_reason={finish}, usage={usage}"
        outcome.text = text
    except Exception as e:  # the test classifies every failure below, whatever the client raised
        outcome.error = f"{type(e).__name__}: {e}"
    outcome.ended = time.monotonic()
    return outcome


def wait_finished(replicas: list[Replica], before: list[float], expected: int, timeout_s: float = 10) -> list[int]:
    """Per-replica finished-request deltas once they add up to `expected` (counters trail responses)."""
    deadline = time.monotonic() + timeout_s
    while True:
        deltas = [int(r.num_finished() - b) for r, b in zip(replicas, before)]
        if sum(deltas) >= expected or time.monotonic() > deadline:
            return deltas
        time.sleep(0.05)


def test_nginx_own_413_uses_the_openai_envelope(proxy):
    r = httpx.post(f"{proxy.url}/v1/completions", content=b"x" * (5 * 1024 * 1024),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_concurrent_traffic_is_served_by_both_replicas(proxy, model_name):
    client = proxy.client()
    before = [r.num_finished() for r in proxy.replicas]
    jobs = [(prompt, stream) for prompt in PROMPTS for stream in (False, True)] * 2
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda job: complete(client, model_name, *job), jobs))
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{failed}\n{proxy.logs()}"
    deltas = wait_finished(proxy.replicas, before, len(jobs))
    # Each request ran on exactly one replica (no retries while both are up), and both got some.
    assert sum(deltas) == len(jobs), deltas
    assert min(deltas) >= 1, f"finished requests per replica: {deltas}"
    log = proxy.access_log(wait_for=[o.request_id for o in outcomes])
    assert {len(log[o.request_id]["upstreams"]) for o in outcomes} == {1}
    assert {a for o in outcomes for a in log[o.request_id]["upstreams"]} == {r.addr for r in proxy.replicas}
    # Greedy answers do not depend on the replica: the replicas are interchangeable.
    for prompt in PROMPTS:
        texts = {o.text for (p, _), o in zip(jobs, outcomes) if p == prompt}
        assert len(texts) == 1, (prompt, texts)


def test_same_session_id_lands_on_one_replica(proxy, model_name):
    """Each session's concurrent requests go to one replica (least_conn would split them), and
    different sessions use both replicas."""
    client = proxy.client()
    homes: dict[str, int] = {}
    for i in range(24):
        session = f"session-{i}"
        before = [r.num_finished() for r in proxy.replicas]
        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(
                lambda stream: complete(client, model_name, PROMPTS[0], stream, 2, {"x-session-id": session}),
                [False, True, False],
            ))
        assert all(o.ok for o in outcomes), outcomes
        deltas = wait_finished(proxy.replicas, before, 3)
        assert sorted(deltas) == [0, 3], f"{session}: finished requests per replica {deltas}"
        homes[session] = deltas.index(3)
        if len(homes) >= 4 and len(set(homes.values())) == 2:
            break
    assert len(set(homes.values())) == 2, f"24 sessions all hashed to one replica: {homes}"
    # and a session comes back to the same replica later
    first = "session-0"
    before = [r.num_finished() for r in proxy.replicas]
    assert complete(client, model_name, PROMPTS[1], False, 2, {"x-session-id": first}).ok
    deltas = wait_finished(proxy.replicas, before, 1)
    assert deltas.index(1) == homes[first], deltas


def test_replica_killed_mid_run(proxy, model_name):
    """Kill replica B (SIGKILL) while both serve a steady mixed load; keep the load going."""
    client = proxy.client()
    survivor, victim = proxy.replicas
    num_workers, max_tokens, after_kill_wanted = 6, 12, 18
    outcomes: list[Outcome] = []
    lock, stop = threading.Lock(), threading.Event()
    killed_at: list[float] = []

    def worker(index: int) -> None:
        stream = index % 2 == 1   # half the workers stream, half do not
        for n in itertools.count():
            if stop.is_set():
                return
            outcome = complete(client, model_name, PROMPTS[(index + n) % len(PROMPTS)], stream, max_tokens)
            with lock:
                outcomes.append(outcome)

    def started_after_kill() -> list[Outcome]:
        with lock:
            return [o for o in outcomes if killed_at and o.started > killed_at[0]]

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(num_workers)]
    for t in threads:
        t.start()
    try:
        # Mid-run: the victim is generating for someone when it dies.
        deadline = time.monotonic() + 30
        while victim.metric("pagoda:num_requests_running") < 2:
            assert time.monotonic() < deadline, f"the victim never ran 2 requests at once\n{proxy.logs()}"
            time.sleep(0.05)
        killed_at.append(time.monotonic())
        victim.kill()
        deadline = time.monotonic() + 45
        while len(started_after_kill()) < after_kill_wanted and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    kill_time = killed_at[0]
    log = proxy.access_log(wait_for=[o.request_id for o in outcomes])

    def tried(o: Outcome) -> list[str] | None:
        """The replicas nginx tried for `o`, in order (None: nginx logged no such request)."""
        return log[o.request_id]["upstreams"] if o.request_id in log else None

    assert all(tried(o) for o in outcomes), [o for o in outcomes if not tried(o)]
    after = [o for o in outcomes if o.started > kill_time]
    assert len(after) >= after_kill_wanted, f"only {len(after)} requests after the kill\n{proxy.logs()}"

    # 1. Nothing started after the kill failed: streamed or not.
    failed_after = [o for o in after if not o.ok]
    assert not failed_after, f"{failed_after}\n{proxy.logs()}"
    # 2. No non-streamed request failed, even one running on the victim at the kill: no byte had
    #    reached its client, so nginx ran it again on the survivor.
    failed_plain = [o for o in outcomes if not o.ok and not o.stream]
    assert not failed_plain, f"{failed_plain}\n{proxy.logs()}"
    # 3. The only failures allowed: streams that were running on the victim when it died.
    for o in outcomes:
        if not o.ok:
            assert o.started < kill_time < o.ended and tried(o) == [victim.addr], (o, tried(o))
    # 4. Retries happened, on the survivor, and every retried request succeeded.
    retried = [o for o in outcomes if tried(o) == [victim.addr, survivor.addr]]
    assert retried, f"no request was retried on the survivor\n{proxy.logs()}"
    assert all(o.ok for o in retried), retried
    # 5. nginx marked the victim down instead of trying it for every new request (least_conn
    #    would otherwise pick the victim, with no open connections, nearly every time).
    first_tries = sum(1 for o in after if tried(o)[0] == victim.addr)
    windows = 1 + int((max(o.ended for o in after) - kill_time) // proxy.fail_timeout_s)
    allowed = proxy.max_fails + num_workers * windows
    assert first_tries <= allowed, f"{first_tries} of {len(after)} new requests still tried the victim first"
    disabled = [line for line in proxy.error_log().splitlines()
                if "upstream server temporarily disabled" in line and victim.addr in line]
    assert disabled, f"nginx never logged the victim as disabled\n{proxy.logs()}"
    # The survivor answered everything started after the kill, and is still healthy.
    assert all(tried(o)[-1] == survivor.addr for o in after)
    assert httpx.get(f"{survivor.url}/health", timeout=5).status_code == 200


def test_no_replica_left_gives_502_in_the_openai_envelope(proxy, model_name):
    for replica in proxy.replicas:
        replica.kill()
    r = httpx.post(f"{proxy.url}/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 502
    body = r.json()
    assert body["error"]["code"] == "no_replica_available" and body["error"]["type"] == "server_error", body
