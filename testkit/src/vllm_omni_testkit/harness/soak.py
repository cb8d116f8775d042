"""A soak of a served omni deployment: a mix of requests at a given concurrency, stage kills, and what the
deployment's processes hold over time. ``benchmarks/soak.py`` runs it from the command line; the test
suite runs a CI-sized one.

The mix: text-to-image (``t2i``), image edits (``edit``), requests the server must refuse (``bad``: a
size off the grid, an unknown field, malformed JSON) and clients that go away half-way
(``disconnect``). At chosen points the diffusion process or the AR engine core is SIGKILLed while it
serves requests. Every outcome is either expected (200 for t2i and edits, 400 for bad requests, a
disconnect or a 200 for disconnects) or counted as unexpected with its detail. The report gives outcomes
by kind, latency p50/p99 of the answered requests, the RSS of every process of the deployment and the
``/dev/shm`` segments it holds at the start (after a warm-up), the middle and the end.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import io
import os
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from vllm_omni_plugin.processes import SHM_DIR, cmdline, descendants, rss_bytes
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.leaks import LeakWatch

KINDS = ("t2i", "edit", "bad", "disconnect")
DEFAULT_MIX = {"t2i": 0.7, "edit": 0.15, "bad": 0.08, "disconnect": 0.07}
EXPECTED = {"t2i": {"200"}, "edit": {"200"}, "bad": {"400"}, "disconnect": {"disconnected", "200"}}
BAD_BODIES: tuple[tuple[str, bytes], ...] = (
    ("size off the grid", b'{"prompt": "a cat", "size": "64x50"}'),
    ("unknown field", b'{"prompt": "a cat", "colour": "red"}'),
    ("malformed JSON", b'{"prompt": "a cat", '),
    ("n out of range", b'{"prompt": "a cat", "n": 0}'),
)


CLIENT_KEEPALIVE_S = 1.0
"""How long the soak's client keeps an idle connection for reuse: well under the server's keep-alive
timeout (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s). With httpx's default (also 5 s) a connection the server
closes for idleness can be picked for the next request in the same instant, which then fails with a bare
``ReadError`` (the likely cause of one seen under heavy load); a client that drops idle connections first
never meets that race."""


@dataclass
class SoakSettings:
    requests: int = 150
    concurrency: int = 8
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    kills: dict[int, str] = field(default_factory=dict)
    """Request count -> the stage to SIGKILL once that many requests were sent (``dit`` or ``ar``)."""
    size: int = 64
    steps: int = 4
    seed: int = 0
    request_timeout: float = 600.0
    sample_every: int | None = None
    """Also sample the deployment every this many requests (besides start, middle and end)."""


@dataclass
class Sample:
    """The deployment at one moment: RSS per process and the shared memory it holds."""

    label: str
    sent: int
    rss: dict[str, int]
    """``role pid`` -> resident bytes."""
    segments: dict[str, int]
    """Count by kind: ``psm`` and ``sem`` (vLLM's, multiprocessing's), ``one-off`` (ours, one value
    each), ``pool free`` (reusable capacity of a live process's pool), ``pool put`` (a value not collected
    yet), ``pool held`` (a value a receiver still reads), ``pool orphaned`` (in the pool of a process that
    is gone)."""
    segment_bytes: int
    held_writers: dict[str, int] = field(default_factory=dict)
    """``pool held`` by the role of the process that wrote the value (its reader is the other side)."""

    @property
    def segment_count(self) -> int:
        return sum(self.segments.values())

    @property
    def holding(self) -> int:
        """Segments that are neither reusable pool capacity nor values in flight: what a leak adds to."""
        in_pools = sum(self.segments.get(k, 0) for k in ("pool free", "pool held", "pool put"))
        return self.segment_count - in_pools


@dataclass
class SoakReport:
    settings: SoakSettings
    outcomes: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    unexpected: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    samples: list[Sample] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def percentile(self, kind: str, q: float) -> float | None:
        values = sorted(self.latencies.get(kind, []))
        if not values:
            return None
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    def sample(self, label: str) -> Sample:
        return next(s for s in self.samples if s.label == label)

    @property
    def segment_growth(self) -> int:
        """Segments held at the end beyond those held at the start, pool capacity and values in flight
        aside: pools are reused and fill to the mix's working set (bounded by their ``pool_bytes``), and a
        value in flight is freed when its reader lets go; what else grows is a leak."""
        return self.sample("end").holding - self.sample("start").holding

    @property
    def uncollected_values(self) -> int:
        """Pooled values put and never collected, at the end (after the deployment settled)."""
        return self.sample("end").segments.get("pool put", 0)

    def format(self) -> str:
        lines = [
            f"{sum(self.outcomes.values())} requests in {self.seconds:.0f} s at concurrency "
            f"{self.settings.concurrency}; stage kills: {', '.join(self.kills) or 'none'}",
            "outcomes by kind:",
        ]
        for kind in KINDS:
            got = {o: n for (k, o), n in sorted(self.outcomes.items()) if k == kind}
            if got:
                lines.append(f"  {kind:10s} " + ", ".join(f"{o}: {n}" for o, n in got.items()))
        lines.append(f"unexpected: {len(self.unexpected)}")
        lines += [f"  {u}" for u in self.unexpected[:20]]
        for kind in ("t2i", "edit"):
            p50, p99 = self.percentile(kind, 0.5), self.percentile(kind, 0.99)
            if p50 is not None and p99 is not None:
                lines.append(f"latency {kind:5s} p50 {p50:.2f} s  p99 {p99:.2f} s")
        lines.append("RSS (MiB) per process at " + " / ".join(s.label for s in self.samples) + ":")
        roles = sorted({role for s in self.samples for role in s.rss})
        for role in roles:
            values = [s.rss.get(role) for s in self.samples]
            lines.append(
                f"  {role:32s} " + " / ".join("-" if v is None else f"{v / 2**20:.0f}" for v in values)
            )
        lines.append("/dev/shm segments the deployment holds (count by kind; MiB):")
        for sample in self.samples:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(sample.segments.items()))
            size = f"{sample.segment_bytes / 2**20:.0f} MiB"
            writers = ", ".join(f"{k} {n}" for k, n in sorted(sample.held_writers.items()))
            held = f" (held values written by: {writers})" if writers else ""
            lines.append(f"  {sample.label:8s} {sample.segment_count}: {kinds}; {size}{held}")
        lines.append(
            f"segment growth (end - start, pool capacity and values in flight aside): {self.segment_growth}; "
            f"values never collected at the end: {self.uncollected_values}"
        )
        return "\n".join(lines)


class Deployment:
    """A served deployment seen from outside: its HTTP base URL and its main process."""

    def __init__(self, base_url: str, main_pid: int, model: str) -> None:
        self.base_url = base_url
        self.main_pid = main_pid
        self.model = model
        self.watch = LeakWatch(root=main_pid, only_new=False)  # it runs already: count what it holds

    def stage_pids(self) -> dict[str, list[int]]:
        health = http_client.get(self.base_url + "/health", timeout=30).json()
        return {
            sid: [r["pid"] for r in stage["replicas"] if r["pid"]] for sid, stage in health["stages"].items()
        }

    def inflight(self, stage: str) -> int:
        health = http_client.get(self.base_url + "/health", timeout=30).json()
        return sum(r["inflight"] for r in health["stages"][stage]["replicas"])

    def roles(self) -> dict[int, str]:
        """Pid -> role of every process of the deployment."""
        stages = self.stage_pids()
        roles = {self.main_pid: "api server"}
        for pid in stages.get("0", []):
            roles[pid] = "ar EngineCore"
            for child in descendants(pid):
                roles[child] = "ar worker"
        for pid in stages.get("1", []):
            roles[pid] = "dit process"
        for pid in descendants(self.main_pid):
            if pid not in roles:
                roles[pid] = "resource tracker" if "resource_tracker" in cmdline(pid) else "other"
        return roles

    def sample(self, label: str, sent: int) -> Sample:
        self.watch.poll()
        rss = {}
        roles = self.roles()
        for pid, role in roles.items():
            value = rss_bytes(pid)
            if value is not None:
                rss[f"{role} {pid}"] = value
        kinds: collections.Counter[str] = collections.Counter()
        held: collections.Counter[str] = collections.Counter()
        total = 0
        for name in self.watch.left_segments():
            path = os.path.join(SHM_DIR, name)
            try:
                total += os.stat(path).st_size
            except OSError:
                continue
            if name.startswith(("psm_", "sem.")):
                kinds[name[:3]] += 1
            elif "_pool_" not in name:
                kinds["one-off"] += 1
            elif int(name.split("_")[2]) not in roles:
                kinds["pool orphaned"] += 1
            else:
                state = _pool_state(path)
                kinds[f"pool {state}"] += 1
                if state == "held":
                    held[roles[int(name.split("_")[2])]] += 1
        return Sample(label, sent, rss, dict(kinds), total, dict(held))

    def kill(self, stage: str) -> str:
        """SIGKILL the stage's process (``dit``) or engine core (``ar``) once it serves requests."""
        sid = {"ar": "0", "dit": "1"}[stage]
        deadline = time.monotonic() + 60
        while self.inflight(sid) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        (pid,) = self.stage_pids()[sid][:1]
        os.kill(pid, signal.SIGKILL)
        return f"{stage} (pid {pid}) at {time.strftime('%H:%M:%S')}"

    def quiesce(self, timeout: float = 120.0) -> None:
        """Until no stage has requests in flight and every replica is back."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = http_client.get(self.base_url + "/health", timeout=30)
            stages = health.json()["stages"].values()
            if health.status_code == 200 and all(
                r["inflight"] == 0 and r["state"] == "ready" for s in stages for r in s["replicas"]
            ):
                return
            time.sleep(0.2)
        raise TimeoutError("the deployment did not settle")


def _pool_state(path: str) -> str:
    """The state of one of our pooled segments (see ``connectors.shm_segment``)."""
    import mmap

    from vllm_omni_plugin.connectors import shm_segment

    try:
        with (
            open(path, "rb") as f,
            mmap.mmap(f.fileno(), shm_segment.HEADER_BYTES, prot=mmap.PROT_READ) as mm,
        ):
            state = shm_segment.state_of(shm_segment.read_state(mm))
    except (OSError, ValueError):
        return "gone"
    return {shm_segment.FREE: "free", shm_segment.PUT: "put", shm_segment.HELD: "held"}.get(state, "?")


def _png(side: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


async def _one(
    client: httpx.AsyncClient,
    deployment: Deployment,
    settings: SoakSettings,
    kind: str,
    i: int,
    rng: random.Random,
) -> tuple[str, float, str]:
    """(outcome, seconds, detail) of request ``i`` of ``kind``."""
    size = f"{settings.size}x{settings.size}"
    body: dict[str, Any] = {
        "model": deployment.model, "prompt": f"a red fox number {i}", "size": size, "seed": i,
        "num_inference_steps": settings.steps,
    }  # fmt: skip
    start = time.perf_counter()
    if kind == "edit":
        files = {"image": ("source.png", _png(settings.size, i), "image/png")}
        data = {k: str(v) for k, v in body.items()}
        call = client.post("/v1/images/edits", data=data, files=files)
    elif kind == "bad":
        what, content = BAD_BODIES[i % len(BAD_BODIES)]
        call = client.post(
            "/v1/images/generations", content=content, headers={"content-type": "application/json"}
        )
    else:
        call = client.post("/v1/images/generations", json=body)
    task = asyncio.ensure_future(call)
    if kind == "disconnect":
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.2, 2.0))
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            return "disconnected", time.perf_counter() - start, ""
    try:
        response = await task
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.perf_counter() - start, str(exc)[:200]
    seconds = time.perf_counter() - start
    detail = ""
    if response.status_code == 200:
        data = response.json().get("data") or [{}]
        if not data[0].get("b64_json") or not base64.b64decode(data[0]["b64_json"]).startswith(b"\x89PNG"):
            return "200 without an image", seconds, response.text[:200]
    else:
        detail = response.text[:300]
    return str(response.status_code), seconds, detail


def _kinds(settings: SoakSettings) -> list[str]:
    rng = random.Random(settings.seed)
    names = list(settings.mix)
    weights = [settings.mix[n] for n in names]
    return [rng.choices(names, weights)[0] for _ in range(settings.requests)]


async def _drive(
    deployment: Deployment, settings: SoakSettings, report: SoakReport, kinds: Sequence[str], sample: bool
) -> None:
    rng = random.Random(settings.seed + 1)
    gate = asyncio.Semaphore(settings.concurrency)
    middle = len(kinds) // 2 if sample else -1
    sent = 0
    loop = asyncio.get_running_loop()
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
    async with httpx.AsyncClient(
        base_url=deployment.base_url, timeout=settings.request_timeout, limits=limits
    ) as client:

        async def run(i: int, kind: str) -> None:
            try:
                outcome, seconds, detail = await _one(client, deployment, settings, kind, i, rng)
            finally:
                gate.release()
            report.outcomes[(kind, outcome)] += 1
            if outcome == "200" and kind in ("t2i", "edit"):
                report.latencies[kind].append(seconds)
            if outcome not in EXPECTED[kind]:
                report.unexpected.append(f"request {i} ({kind}): {outcome} {detail}")

        tasks = []
        for i, kind in enumerate(kinds):
            await gate.acquire()
            if i == middle:
                report.samples.append(await loop.run_in_executor(None, deployment.sample, "middle", sent))
            elif sample and settings.sample_every and i and i % settings.sample_every == 0:
                report.samples.append(await loop.run_in_executor(None, deployment.sample, f"@{i}", sent))
            if i in settings.kills:
                report.kills.append(await loop.run_in_executor(None, deployment.kill, settings.kills[i]))
            tasks.append(asyncio.ensure_future(run(i, kind)))
            sent += 1
        await asyncio.gather(*tasks)


def run_soak(deployment: Deployment, settings: SoakSettings) -> SoakReport:
    """Warm up (each kind once, at full concurrency), sample, drive the mix with its kills, settle,
    sample again."""
    report = SoakReport(settings)
    deployment.watch.start()
    try:
        warm = SoakSettings(**{**settings.__dict__, "requests": settings.concurrency, "kills": {}})
        warm_kinds = [KINDS[i % len(KINDS)] for i in range(settings.concurrency)]
        asyncio.run(_drive(deployment, warm, SoakReport(warm), warm_kinds, sample=False))
        deployment.quiesce()
        report.samples.append(deployment.sample("start", 0))
        start = time.perf_counter()
        asyncio.run(_drive(deployment, settings, report, _kinds(settings), sample=True))
        report.seconds = time.perf_counter() - start
        deployment.quiesce()
        time.sleep(1.0)  # outputs of aborted requests come back and are freed
        report.samples.append(deployment.sample("end", settings.requests))
    finally:
        deployment.watch.stop()
    report.samples.sort(key=lambda s: s.sent)
    return report
