"""The checks of ``make compose-test`` on a running stack (compose_stack.Stack), each from the
host as an operator would: HTTP on the published router port, ``kvmesh generate`` and ``kvmesh
admin status`` run here, Prometheus's targets API, ``docker kill`` / ``docker start``.

Each returns a ``Verdict``: passed or not, and one line saying what was seen."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from compose_host import ROOT, run
from compose_stack import Stack

KVMESH = str(ROOT / ".venv" / "bin" / "kvmesh")
# The kill check's load: requests long enough (EOS ignored) that the killed worker holds some.
LOAD_TOKENS = 128
LOAD_CLIENTS = 6
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime, step by step, in plain words.",
)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    detail: str


@dataclass(frozen=True)
class Outcome:
    """One request of the load: its HTTP status, its text or its error's message."""

    status: int
    text: str | None = None
    error: str | None = None


def kvmesh_services(compose: dict[str, Any]) -> list[str]:
    """What each service of a parsed docker-compose.yml serves (``kvmesh serve X``): X is also
    the role its heartbeats carry and its Prometheus job."""
    commands = [svc.get("command", []) for svc in compose["services"].values()]
    return sorted(c[2] for c in commands if c[:2] == ["kvmesh", "serve"])


def expected_roles(services: list[str], scale: dict[str, int]) -> Counter:
    """The workers the registry should list: one of each service, ``scale`` of the pools."""
    return Counter({name: scale.get(name, 1) for name in services})


def stack_roles(stack: Stack) -> Counter:
    import yaml  # PyYAML: a dev dependency of the project

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return expected_roles(kvmesh_services(compose), stack.settings.scale)


# The prefill-queue keeper sends no heartbeat (it serves no requests): admin status shows its
# work, the queue (``prefill_queue``: depth and consumers, or a note that it is missing).
NO_HEARTBEAT = ("prefill-queue",)


def heartbeat_roles(roles: Counter) -> Counter:
    """The roles of ``roles`` that the registry lists as workers."""
    return Counter({role: n for role, n in roles.items() if role not in NO_HEARTBEAT})


def queue_made(status: dict[str, Any]) -> bool:
    """Whether admin status found the prefill queue (the keeper made it)."""
    queue = status.get("prefill_queue")
    return isinstance(queue, dict) and "note" not in queue


def roles_listed(status: dict[str, Any]) -> Counter:
    """Live workers by role in ``kvmesh admin status --json`` (its workers list has the
    kv-registry's own heartbeat too)."""
    return Counter(row["role"] for row in status.get("workers", []))


def judge(outcome: Outcome, expected: str) -> str:
    """``right`` (the greedy text), ``clear-error`` (an HTTP error with a message) or what is
    wrong with it."""
    if outcome.status == 200:
        return "right" if outcome.text == expected else "wrong-text"
    if outcome.status >= 400 and outcome.error:
        return "clear-error"
    return f"unclear-{outcome.status}"


def targets_up(targets: list[dict[str, Any]]) -> tuple[Counter, list[str]]:
    """Prometheus's active targets: how many are up per job, and the ones that are not."""
    up = Counter(t["labels"]["job"] for t in targets if t["health"] == "up")
    down = [
        f"{t['labels']['job']} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}".strip()
        for t in targets
        if t["health"] != "up"
    ]
    return up, down


def retries(metrics: str) -> dict[str, float]:
    """``kvmesh_router_retries_total`` by role from the router's /metrics text: requests run
    again because a worker died (before their first token), ``decode-migrate`` streams moved."""
    found = re.findall(r'^kvmesh_router_retries_total\{role="([^"]+)"\} (\S+)$', metrics, re.M)
    return {role: float(value) for role, value in found}


def router_retries(stack: Stack) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{stack.router_url}/metrics", timeout=10) as resp:
        return retries(resp.read().decode())


# --- completions against kvmesh generate --------------------------------------------------------


def generate(model: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
    argv = [KVMESH, "generate", "--model", model, "--prompt", prompt]
    argv += ["--max-tokens", str(max_tokens), "--temperature", "0", "--json"]
    return json.loads(run([*argv, "--ignore-eos"] if ignore_eos else argv, 600).stdout)


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    ignore_eos: bool = False,
) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            payload = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        return Outcome(0, error=f"{type(exc).__name__}: {exc}")  # no HTTP answer: not clear
    if resp.status == 200:
        return Outcome(200, text=payload["choices"][0]["text"])
    return Outcome(resp.status, error=(payload.get("error") or {}).get("message"))


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


async def check_completions(stack: Stack, host_model: str, expected: dict[str, str]) -> Verdict:
    """Each prompt, greedy, through the published router port: the same text as ``kvmesh
    generate`` on the host with the same weights."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        name = await served_model(session, stack.router_url)
        got = [await complete(session, stack.router_url, name, p, 16) for p in PROMPTS]
    bad = [
        i
        for i, (o, p) in enumerate(zip(got, PROMPTS, strict=True))
        if judge(o, expected[p]) != "right"
    ]
    detail = f"{len(PROMPTS)} prompts through {stack.router_url} ({name}), 16 tokens greedy"
    if bad:
        return Verdict(False, f"{detail}: prompts {bad} differ: {[got[i] for i in bad]}")
    return Verdict(True, f"{detail}: equal to kvmesh generate --model {host_model}")


# --- replicas in the admin status and in Prometheus ---------------------------------------------


def admin_status(stack: Stack) -> dict[str, Any]:
    env = {
        **stack.env,
        "KVMESH_NATS_URL": stack.nats_url,
        "KVMESH_MESH": stack.settings.mesh,
        "KVMESH_NATS_USER": "admin",
        "KVMESH_NATS_PASSWORD": stack.passwords["KVMESH_NATS_PASSWORD_ADMIN"],
    }
    return json.loads(run([KVMESH, "admin", "status", "--json"], 60, env=env).stdout)


async def until(probe, timeout_s: float, every_s: float = 2.0):
    """Call ``probe()`` (blocking; run in a thread) until it returns (ok, value) with ok, or
    ``timeout_s`` passes; returns the last (ok, value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok, value = await asyncio.to_thread(probe)
        if ok or time.monotonic() > deadline:
            return ok, value
        await asyncio.sleep(every_s)


async def check_replicas(stack: Stack) -> Verdict:
    """``kvmesh admin status`` lists every replica of every kvmesh service that heartbeats, and
    the prefill queue its keeper made."""
    want = heartbeat_roles(stack_roles(stack))

    def probe() -> tuple[bool, tuple[Counter, Any]]:
        status = admin_status(stack)
        roles = roles_listed(status)
        return roles == want and queue_made(status), (roles, status.get("prefill_queue"))

    ok, (roles, queue) = await until(probe, 60)
    seen = ", ".join(f"{role} {n}" for role, n in sorted(roles.items()))
    detail = f"kvmesh admin status lists {seen}; prefill queue {queue}"
    return Verdict(ok, detail + ("" if ok else f"; want {dict(want)} and the queue made"))


async def check_prometheus(stack: Stack) -> Verdict:
    """Prometheus (found by DNS, deploy/prometheus.yml) scrapes every replica and each is up."""
    want = stack_roles(stack)
    url = f"{stack.prometheus_url}/api/v1/targets?state=active"

    def probe() -> tuple[bool, tuple[Counter, list[str]]]:
        import urllib.request

        with urllib.request.urlopen(url, timeout=10) as resp:
            targets = json.load(resp)["data"]["activeTargets"]
        up, down = targets_up(targets)
        return up == want and not down, (up, down)

    ok, (up, down) = await until(probe, 90)
    seen = ", ".join(f"{job} {n}" for job, n in sorted(up.items()))
    detail = f"Prometheus targets up: {seen}"
    return Verdict(ok, detail if ok else f"{detail}; want {dict(want)}; not up: {down}")


# --- a decode container killed under load -------------------------------------------------------


def worker_ids(logs: str) -> list[str]:
    """The worker ids a container's JSON log lines announced ready, in order (one per start)."""
    ids = []
    for line in logs.splitlines():
        try:
            record = json.loads(line[line.index("{") :])
        except ValueError:
            continue
        if record.get("worker_id") and "metrics_port" in record:
            ids.append(record["worker_id"])
    return ids


def container_logs(container: str) -> str:
    proc = subprocess.run(
        ["docker", "logs", container], capture_output=True, text=True, check=False
    )
    return proc.stdout + proc.stderr


async def load(url: str, model: str, clients: int, duration_s: float) -> list[tuple[str, Outcome]]:
    """``clients`` loops sending the prompts back to back for ``duration_s``, ``LOAD_TOKENS``
    tokens each, EOS ignored."""
    results: list[tuple[str, Outcome]] = []
    deadline = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=180)

    async def client(i: int) -> None:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            n = i
            while time.monotonic() < deadline:
                prompt = PROMPTS[n % len(PROMPTS)]
                outcome = await complete(session, url, model, prompt, LOAD_TOKENS, ignore_eos=True)
                results.append((prompt, outcome))
                n += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return results


async def decode_rows_under_load(stack: Stack, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The admin status's decode rows once one shows a running request (polled every 0.1 s
    over one admin connection: the CLI takes a second a call), or the last ones seen."""
    import msgspec
    from kvmesh.shared.bus.admin_client import admin_client
    from kvmesh.shared.bus.nats_auth import ADMIN, NatsAuth

    auth = NatsAuth(ADMIN, stack.passwords["KVMESH_NATS_PASSWORD_ADMIN"])
    deadline = time.monotonic() + timeout_s
    async with admin_client(stack.nats_url, auth=auth, mesh=stack.settings.mesh) as admin:
        while True:
            rows = msgspec.to_builtins((await admin.status()).decode)  # as the CLI prints
            if any(r["load"]["num_running"] for r in rows) or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.1)


def busiest(rows: list[dict[str, Any]], ids_by_container: dict[str, list[str]]) -> str:
    """The container of the decode worker holding the most requests (running, waiting, leased)
    in admin status ``rows``: placement follows cached prefixes, so with a few prompts repeated
    one worker may take them all."""
    row = max(
        rows,
        key=lambda r: (
            r["load"]["num_running"] + r["load"]["num_waiting"] + r["leases"],
            r["worker_id"],
        ),
    )
    for container, ids in ids_by_container.items():
        if ids and ids[-1] == row["worker_id"]:
            return container
    raise AssertionError(f"no decode container announced {row['worker_id']}: {ids_by_container}")


async def check_kill(stack: Stack, expected: dict[str, str]) -> Verdict:
    """``docker kill`` of the busiest decode container while requests run: every request ends
    with the greedy text or an HTTP error that says what happened; ``docker start`` brings the
    replica back (a kill turns Docker's restart policy off), it registers as a new worker, the
    dead one's id is gone, and every decode worker has all its KV blocks free again."""
    async with aiohttp.ClientSession() as session:
        model = await served_model(session, stack.router_url)
    before = router_retries(stack)
    logs = {c: worker_ids(container_logs(c)) for c in stack.containers("decode")}
    task = asyncio.create_task(load(stack.router_url, model, LOAD_CLIENTS, duration_s=25))
    await asyncio.sleep(6)
    rows = await decode_rows_under_load(stack)
    victim = busiest(rows, logs)
    held = {
        r["worker_id"]: f"{r['load']['num_running']} running, {r['leases']} leased" for r in rows
    }
    old_ids = logs[victim]
    run(["docker", "kill", victim], 60)
    results = await task
    after = router_retries(stack)
    rerun = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    judged = [(judge(o, expected[p]), o) for p, o in results]
    verdicts = Counter(v for v, _ in judged)
    errors = sorted({str(o.error) for v, o in judged if v != "right"})
    hit = sum(rerun.values()) > 0 or verdicts["clear-error"] > 0  # the kill met running requests
    ok = set(verdicts) <= {"right", "clear-error"} and verdicts["right"] > 0 and hit

    run(["docker", "start", victim], 60)
    await asyncio.to_thread(stack.wait_healthy, victim, 600)
    new_ids = [i for i in worker_ids(container_logs(victim)) if i not in old_ids]

    def probe() -> tuple[bool, dict[str, Any]]:
        rows = admin_status(stack)["decode"]
        ids = {r["worker_id"] for r in rows}
        returned = all(r["pool"]["free_blocks"] == r["pool"]["total_blocks"] for r in rows)
        rejoined = bool(new_ids) and new_ids[-1] in ids and not ids & set(old_ids)
        return returned and rejoined and len(rows) == stack.settings.scale["decode"], rows

    settled, rows = await until(probe, 90)
    blocks = ", ".join(f"{r['worker_id']} {r['free_blocks']}/{r['total_blocks']}" for r in rows)
    detail = (
        f"{len(results)} requests ({dict(verdicts)}); killed decode {old_ids[-1:]} of {held}, "
        f"run again by the router: {dict(rerun) or 'none (the kill met no running request)'}; "
        f"restarted as {new_ids[-1:]}; free/total blocks: {blocks}"
    )
    if errors:
        detail += f"; errors: {errors[:3]}"
    return Verdict(ok and settled, detail)


def check_down(stack: Stack) -> Verdict:
    """``down -v`` leaves no container, network or volume of the project."""
    stack.down()
    left = stack.leftovers()
    ok = not any(left.values())
    return Verdict(ok, "down -v left " + ", ".join(f"{len(v)} {k}" for k, v in left.items()))
