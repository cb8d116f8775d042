"""The diffusion stage's batching, side by side in one run: the previous behaviour (whole-request batching,
``batching: request``, with the ``max_batch_size: 8`` the shipped deploy file pinned), whole-request
batching within the token budget ``max_step_tokens``, step batching (``batching: step``: groups whose
forwards are shared) and the step loop (``batching: loop``, the default for SD3, FLUX, Qwen-Image,
GLM-Image and BAGEL, here with ``scheduling_policy: priority``), with diffusers' own single call of 16
prompts as the ceiling. Tiny SD3, 64x64, 4 steps (guidance on), the DiT given the machine's cores (its
``OMP_NUM_THREADS``), served over HTTP (``vllm serve --omni``, a thin httpx client).

    python benchmarks/diffusion_engine.py [--model DIR] [--images 64] [--concurrency 1 8 16 32]
                                          [--previous-max-batch-size 8] [--max-step-tokens N [N ...]]
                                          [--batch-wait-ms MS] [--threads N] [--poisson-seconds 20]
                                          [--priority-seconds 15]

``--max-step-tokens`` with several values serves step batching once per budget (how the default was
chosen); the targets are read from the first.

Closed loop: ``c`` clients, each sending its next request when its last one returned; images/s (median
of the timed rounds) and the p50/p99 latency of every request of those rounds. Open loop: Poisson
arrivals at 80% of the peak images/s the previous stage reached, the same arrival times for all; p50/p99
latency. A breakdown per variant and concurrency (the stage's ``/metrics`` over the rounds) says where a
request's time goes: queue wait, prompt encoding, steps, decode, and the rest (HTTP, API server, PNG).
Priority run: one request a second while as many clients as the highest concurrency keep the server
saturated; the step loop's server gets the load at priority 1 and the timed requests at 0, the others
serve both first come, first served; the timed requests' latency against theirs on the idle server.
Then BAGEL's DiT stage alone (the stage's own batch loop, in this process, fed
text-to-image requests with random 12-token contexts as the thinker would send them) with a FLUX-size
autoencoder (128 channels, x1/x2/x4/x4, two blocks per level; the tiny BAGEL otherwise), 64x64, 8
steps, 8 clients: whole-request batching, step batching and the step loop (its default).
Targets: the step loop >= 1.0x the previous images/s at every concurrency and >= 1.3x at 16, a Poisson
p99 <= 0.5x the previous, priority latency under the load <= 1.5x alone, BAGEL's >= 1.0x whole-request
batching at 8; step batching >= 1.15x the previous at 16 (SD3) and whole-request's at 8 (BAGEL).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
SIZE, STEPS = 64, 4
ROUNDS = 3
CEILING_BATCH = 16
PREVIOUS = "previous"
"""The baseline's name in the tables: whole-request batching as it shipped, 8 requests a batch."""
LOOP = "loop"
"""``batching: loop`` with ``scheduling_policy: priority`` (``diffusion/step_loop.py``)."""
BESIDE = "loop, decode beside"
"""The step loop with ``overlap_decode: true``: finished requests decode on a thread of their own beside the
next steps (the default on a GPU; on a CPU the default decodes them between steps)."""


BREAKDOWN = ("latency", "queue", "encode", "steps", "decode", "rest", "per call")
"""Where a request's time goes (:func:`breakdown`)."""


def prompt(i: int) -> str:
    return f"a red fox number {i} in the snow"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def diffusers_ceiling(model: str, images: int, threads: int) -> float:
    """Images/s of diffusers' own pipeline called with ``images`` prompts at once (one generator each):
    what batching can give at most on this machine, with nothing around it."""
    import diffusers
    import torch

    from vllm_omni_testkit.reference.diffusers import pipeline_class

    torch.set_num_threads(threads)
    pipe = getattr(diffusers, pipeline_class(model)).from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def call() -> None:
        generators = [torch.Generator("cpu").manual_seed(i) for i in range(images)]
        prompts = [prompt(i) for i in range(images)]
        pipe(prompts, height=SIZE, width=SIZE, num_inference_steps=STEPS, generator=generators)

    for _ in range(2):  # warm-up: one call left the first timed rounds 5x slow in some runs
        call()
    rates = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        call()
        rates.append(images / (time.perf_counter() - start))
    return statistics.median(rates)


class Client:
    """One HTTP client for a server: image requests, their latencies."""

    def __init__(self, base_url: str, model: str) -> None:
        import httpx

        self.http = httpx.AsyncClient(base_url=base_url, timeout=600)
        self.model = model

    async def one(self, i: int, priority: int | None = None) -> float:
        start = time.perf_counter()
        body = {"model": self.model, "prompt": prompt(i), "size": f"{SIZE}x{SIZE}", "seed": i,
                "num_inference_steps": STEPS}  # fmt: skip
        if priority is not None:
            body["priority"] = priority
        response = await self.http.post("/v1/images/generations", json=body)
        if response.status_code != 200 or b'"b64_json"' not in response.content:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return time.perf_counter() - start

    async def closed_loop(self, images: int, concurrency: int) -> tuple[float, list[float]]:
        """Median images/s over the rounds, and every latency."""
        latencies: list[float] = []
        rates = []
        for _ in range(ROUNDS):
            pending = iter(range(images))
            start = time.perf_counter()
            await asyncio.gather(*(self._worker(pending, latencies) for _ in range(concurrency)))
            rates.append(images / (time.perf_counter() - start))
        return statistics.median(rates), latencies

    async def _worker(self, pending: Iterator[int], latencies: list[float]) -> None:
        for i in pending:  # shared by the round's workers: each takes the next request
            latencies.append(await self.one(i))

    async def open_loop(self, arrivals: list[float]) -> list[float]:
        """Requests sent at ``arrivals`` (seconds from now) whatever is in flight; their latencies."""
        start = time.perf_counter()

        async def at(i: int, when: float) -> float:
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - start)))
            return await self.one(i)

        return list(await asyncio.gather(*(at(i, t) for i, t in enumerate(arrivals))))

    async def priority_run(
        self, seconds: float, load: int, priorities: bool
    ) -> tuple[list[float], list[float]]:
        """One request at a time on the idle server, then one every second for ``seconds`` while ``load``
        clients keep it saturated: the latencies alone and under the load. With ``priorities`` the load
        sends priority 1 and the timed requests 0 (lower first); without, neither sends one (FCFS)."""
        high, low = (0, 1) if priorities else (None, None)
        alone = [await self.one(100_000 + k, high) for k in range(5)]
        stop = time.perf_counter() + seconds + 2.0
        counter = iter(range(200_000, 10**9))

        async def saturate() -> None:
            while time.perf_counter() < stop:
                await self.one(next(counter), low)

        async def timed() -> list[float]:
            await asyncio.sleep(2.0)  # the load first
            out = []
            for k in range(int(seconds)):
                began = time.perf_counter()
                out.append(await self.one(300_000 + k, high))
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - began)))
            return out

        *_, loaded = await asyncio.gather(*(saturate() for _ in range(load)), timed())
        return alone, loaded

    async def close(self) -> None:
        await self.http.aclose()


def poisson_arrivals(rate: float, seconds: float, seed: int = 0) -> list[float]:
    draw = random.Random(seed)
    times, now = [], 0.0
    while True:
        now += draw.expovariate(rate)
        if now > seconds:
            return times
        times.append(now)


Closed = dict[int, tuple[float, list[float], dict[str, float]]]
"""Per concurrency: median images/s, every latency, and the stage's counters over its rounds."""
COUNTERS = (
    "started_requests",
    "queue_wait_seconds",
    "decodes",
    "encode_seconds",
    "decode_seconds",
    "call_seconds",
)
"""The diffusion stage's ``/metrics`` counters (``omni_diffusion_<name>_total``) the breakdown reads."""


async def counters(http: Any) -> dict[str, float]:
    """The diffusion stage's counters, summed over its replicas."""
    text = (await http.get("/metrics")).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(f"omni_diffusion_{name}_total{{"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def breakdown(latencies: list[float], delta: dict[str, float]) -> dict[str, float]:
    """Where a request's time went, in ms: its queue wait, its pipeline call (prompt encoding, steps,
    decode) and the rest (HTTP, the API server, PNG encoding, the hand-over to and from the stage)."""
    calls, started = max(1.0, delta["decodes"]), max(1.0, delta["started_requests"])
    encode, decode, call = (
        1000 * delta[k] / calls for k in ("encode_seconds", "decode_seconds", "call_seconds")
    )
    queue = 1000 * delta["queue_wait_seconds"] / started
    mean = 1000 * statistics.fmean(latencies)
    return {
        "latency": mean,
        "queue": queue,
        "encode": encode,
        "steps": call - encode - decode,
        "decode": decode,
        "rest": mean - queue - call,
        "per call": started / calls,
    }


async def measure(
    base_url: str,
    model: str,
    images: int,
    levels: list[int],
    arrivals_for: Callable[[Closed], list[float]],
    priority: tuple[float, bool],
) -> tuple[Closed, list[float], list[float], tuple[list[float], list[float]]]:
    """The closed-loop runs, then the open-loop one (its arrivals chosen from the closed-loop rates),
    then the priority run (``priority``: its seconds, whether the server takes priorities): (closed,
    arrivals, open-loop latencies, (latencies alone, under the load))."""
    client = Client(base_url, model)
    try:
        await asyncio.gather(*(client.one(i) for i in range(max(levels))))  # warm-up
        closed = {}
        for c in levels:
            before = await counters(client.http)
            rate, latencies = await client.closed_loop(images, c)
            after = await counters(client.http)
            closed[c] = (rate, latencies, {k: after[k] - before[k] for k in COUNTERS})
        arrivals = arrivals_for(closed)
        opened = await client.open_loop(arrivals)
        seconds, priorities = priority
        prioritized = await client.priority_run(seconds, max(levels), priorities)
    finally:
        await client.close()
    return closed, arrivals, opened, prioritized


def deploy_text(fields: dict[str, Any]) -> str:
    """A one-stage diffusers deploy file with these stage fields (the rest default)."""
    lines = "".join(f"    {key}: {value}\n" for key, value in fields.items())
    return f"pipeline: diffusion\nstages:\n  - stage_id: 0\n{lines}"


def serve_and_measure(
    model: str,
    name: str,
    fields: dict[str, Any],
    args: argparse.Namespace,
    levels: list[int],
    arrivals_for: Callable[[Closed], list[float]],
    tmp: str,
) -> tuple[Closed, list[float], list[float], tuple[list[float], list[float]]]:
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

    slug = name.replace(" ", "_").replace("=", "")
    deploy = Path(tmp) / f"diffusion_{slug}.yaml"
    deploy.write_text(deploy_text(fields))
    port = free_port()
    argv = [bin_script("vllm"), "serve", model, "--omni", "--deploy-config", str(deploy),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = cpu_test_env({"OMP_NUM_THREADS": str(args.threads)})
    log = ROOT / "out" / f"bench_diffusion_engine_{slug}.log"
    with ServerProcess(argv, port=port, log_path=log, env=env) as server:
        server.wait_ready(timeout=600)
        priority = (args.priority_seconds, fields.get("scheduling_policy") == "priority")
        return asyncio.run(measure(server.base_url, model, args.images, levels, arrivals_for, priority))


BAGEL_RUNNER = "vllm_omni_plugin.families.bagel.runner.BagelGenerationRunner"
FLUX_VAE = {"ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2}
"""FLUX's autoencoder widths (BAGEL's real one), in place of the tiny BAGEL's."""


def bagel_with_flux_vae(directory: Path) -> str:
    """The tiny BAGEL with a FLUX-size autoencoder, built in ``directory``."""
    from vllm_omni_plugin.tiny_models.bagel import bagel_config, build_bagel

    cfg = bagel_config()
    cfg["vae"].update(FLUX_VAE)
    directory.mkdir(parents=True, exist_ok=True)
    build_bagel(directory, cfg)
    return str(directory)


def bagel_request(model_cfg: Any, i: int, size: int, steps: int) -> Any:
    """A text-to-image request for BAGEL's DiT with a random 12-token context."""
    import msgspec
    import torch

    from vllm_omni_plugin.families.bagel.request import T2I_DEFAULTS, BagelContext, BagelGenerationRequest

    gen = torch.Generator().manual_seed(i)
    layers, kv_heads, head_dim = model_cfg
    kv = torch.randn((layers, 2, 12, kv_heads, head_dim), generator=gen)
    cond = BagelContext(kv=kv, kv_len=12, rope=12)
    return BagelGenerationRequest(
        request_id=f"b{i}",
        cond=cond,
        cfg_text=BagelContext.empty(),
        cfg_img=cond,
        height=size,
        width=size,
        sampling=msgspec.structs.replace(T2I_DEFAULTS, num_inference_steps=steps),
        seed=i,
    )


def dit_closed_loop(
    model: str, fields: dict[str, Any], clients: int, images: int, size: int, steps: int
) -> tuple[float, list[float], dict[str, float]]:
    """BAGEL's DiT stage alone, its batch loop in this process: median images/s, every latency and the
    engine's counters over the timed rounds."""
    import msgspec

    from vllm_omni_plugin.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
    from vllm_omni_plugin.stage.core_types import StageDiffusionCoreRequest
    from vllm_omni_plugin.stage.diffusion_loop import BatchReport, DiffusionBatchLoop

    engine = DiffusionEngine(
        model, DiffusionEngineConfig(runner_cls=BAGEL_RUNNER, max_batch_size=clients, **fields)
    )
    model_cfg = (
        engine.runner.transformer.num_layers,
        engine.runner.transformer.num_kv_heads,
        engine.runner.transformer.head_dim,
    )
    done: dict[str, float] = {}
    changed = threading.Condition()

    died: list[BaseException] = []
    """What stopped the stage's loop (the clients then stop waiting, and the run fails)."""

    class Report(BatchReport):
        def outputs(self, outputs: list[Any]) -> None:
            with changed:
                for output in outputs:
                    assert output.error is None, output.error
                    done[output.request_id] = time.perf_counter()
                changed.notify_all()

        def dropped(self, request_ids: list[str], where: str) -> None:
            raise RuntimeError(f"dropped {request_ids}")

    loop = DiffusionBatchLoop(engine, 1, Report(), max_batch=clients)

    def serve() -> None:
        try:
            loop.serve()
        except BaseException as exc:
            with changed:
                died.append(exc)
                changed.notify_all()
            raise

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    latencies: list[float] = []

    def client(first: int, count: int, record: bool) -> None:
        for i in range(first, first + count):
            request = bagel_request(model_cfg, i, size, steps)
            start = time.perf_counter()
            loop.inbox.add(
                StageDiffusionCoreRequest(request_id=request.request_id, stage_id=1, diffusion=request)
            )
            with changed:
                changed.wait_for(lambda rid=request.request_id: rid in done or died)
            if died:
                return
            if record:
                latencies.append(done[request.request_id] - start)

    def round_(offset: int, record: bool) -> float:
        per = images // clients
        threads = [
            threading.Thread(target=client, args=(offset + k * per, per, record)) for k in range(clients)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if died:
            raise RuntimeError("the DiT stage's loop stopped") from died[0]
        return per * clients / (time.perf_counter() - start)

    try:
        round_(10_000, False)  # warm-up
        before = msgspec.to_builtins(engine.counters())
        rates = [round_(20_000 * (r + 1), True) for r in range(ROUNDS)]
        after = msgspec.to_builtins(engine.counters())
    finally:
        loop.inbox.drain()
        serving.join()
    delta = {key: after[key] - before[key] for key in after}
    delta["started_requests"] = delta.pop("started")
    return statistics.median(rates), latencies, delta


BAGEL_VARIANTS: dict[str, dict[str, Any]] = {
    "request": {"batching": "request"},
    "step": {"batching": "step"},
    "loop": {"batching": "loop"},
    BESIDE: {"batching": "loop", "overlap_decode": True},
}


def bagel_dit_stage(args: argparse.Namespace) -> None:
    """BAGEL's DiT stage alone, in process: whole-request batching, step batching and the step loop (its
    decoder calls between steps, its default on a CPU, and beside the next step)."""
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        bagel = bagel_with_flux_vae(Path(tmp) / "bagel-flux-vae")
        dit = {
            mode: dit_closed_loop(bagel, fields, 8, args.bagel_images, 64, 8)
            for mode, fields in BAGEL_VARIANTS.items()
        }
    print("BAGEL DiT stage, FLUX-size autoencoder, 64x64, 8 steps, 8 clients (closed loop, in process)")
    for mode in dit:
        rate, latencies, _ = dit[mode]
        p50, p99 = (1000 * percentile(latencies, q) for q in (0.5, 0.99))
        print(f"{mode:<22} {rate:>9.2f} images/s   p50 {p50:>7.0f} ms   p99 {p99:>7.0f} ms")
    print(f"{'where its time goes':<22}" + "".join(f"{p:>9}" for p in BREAKDOWN))
    for mode in dit:
        _, latencies, delta = dit[mode]
        row = breakdown(latencies, delta)
        print(f"{mode:<22}" + "".join(f"{row[p]:>9.1f}" for p in BREAKDOWN))
    print(
        f"targets: BAGEL step >= 1.15x request at c=8: {dit['step'][0] / dit['request'][0]:.2f}x; "
        f"BAGEL loop (its default) >= 1.0x request: {dit['loop'][0] / dit['request'][0]:.2f}x; "
        f"decode beside the next step: {dit[BESIDE][0] / dit['loop'][0]:.2f}x the loop's default"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a diffusers directory (default: the tiny SD3)")
    parser.add_argument("--images", type=int, default=64, help="images per timed round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument(
        "--previous-max-batch-size", type=int, default=8, help="whole-request batching's max_batch_size"
    )
    parser.add_argument(
        "--max-step-tokens",
        type=int,
        nargs="*",
        default=[],
        help="step batching's budgets (default: its own)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the DiT's intra-op threads")
    parser.add_argument("--poisson-seconds", type=float, default=20.0, help="length of the open-loop run")
    parser.add_argument(
        "--priority-seconds", type=float, default=15.0, help="timed requests (one a second) under the load"
    )
    parser.add_argument("--batch-wait-ms", type=float, default=None, help="step batching's batch_wait_ms")
    parser.add_argument(
        "--step-max-batch-size",
        type=int,
        default=None,
        help="step batching's max_batch_size (default: unpinned)",
    )
    parser.add_argument("--bagel-images", type=int, default=16, help="BAGEL images per timed round (0: skip)")
    parser.add_argument("--bagel-only", action="store_true", help="only BAGEL's DiT stage (no served SD3)")
    args = parser.parse_args()
    if args.bagel_only:
        bagel_dit_stage(args)
        return 0
    from vllm_omni_plugin.tiny_models import build

    model = args.model or str(build("sd3", ROOT / ".cache" / "tiny_models" / "sd3"))
    levels = sorted(args.concurrency)
    ceiling = diffusers_ceiling(model, CEILING_BATCH, args.threads)
    step_fields: dict[str, Any] = {"batching": "step"}
    if args.batch_wait_ms is not None:
        step_fields["batch_wait_ms"] = args.batch_wait_ms
    if args.step_max_batch_size is not None:
        step_fields["max_batch_size"] = args.step_max_batch_size
    variants: dict[str, dict[str, Any]] = {
        PREVIOUS: {"batching": "request", "max_batch_size": args.previous_max_batch_size},
        "request": {"batching": "request"},  # whole requests, batches bounded by max_step_tokens
    }
    for budget in args.max_step_tokens or [None]:
        name = "step" if budget is None else f"step tokens={budget}"
        variants[name] = step_fields if budget is None else {**step_fields, "max_step_tokens": budget}
    variants[LOOP] = {"batching": "loop", "max_batch_size": max(levels), "scheduling_policy": "priority"}
    variants[BESIDE] = {**variants[LOOP], "overlap_decode": True}
    modes = list(variants)
    closed: dict[str, Closed] = {}
    opened: dict[str, list[float]] = {}
    prioritized: dict[str, tuple[list[float], list[float]]] = {}

    def at_80_percent(rates: Closed) -> list[float]:
        return poisson_arrivals(0.8 * max(rate for rate, _, _ in rates.values()), args.poisson_seconds)

    with tempfile.TemporaryDirectory() as tmp:
        arrivals: list[float] = []

        def same_arrivals(_: Closed) -> list[float]:  # the baseline's, for every variant after it
            return arrivals

        for name, fields in variants.items():
            closed[name], chosen, opened[name], prioritized[name] = serve_and_measure(
                model, name, fields, args, levels, same_arrivals if arrivals else at_80_percent, tmp
            )
            arrivals = arrivals or chosen
    print(
        f"\nmodel={model} size={SIZE} steps={STEPS} threads={args.threads} images/round={args.images} "
        f"rounds={ROUNDS}"
    )
    for name, fields in variants.items():
        print(f"{name}: {fields}")
    print(f"diffusers, one call of {CEILING_BATCH} prompts (ceiling): {ceiling:.2f} images/s")
    print(
        f"{'closed loop':<26} {'images/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'x previous':>11}"
        f" {'/ ceiling':>10}"
    )
    for c in levels:
        for mode in modes:
            rate, latencies, _ = closed[mode][c]
            versus = rate / closed[PREVIOUS][c][0]
            print(
                f"{mode + f', c={c}':<26} {rate:>9.2f} {1000 * percentile(latencies, 0.5):>8.0f} "
                f"{1000 * percentile(latencies, 0.99):>8.0f} {versus:>11.2f} {rate / ceiling:>10.2f}"
            )
    peak = max(rate for rate, _, _ in closed[PREVIOUS].values())
    print("where a request's time goes (ms, means; per call: requests in one pipeline call)")
    print(f"{'closed loop':<26}" + "".join(f"{p:>9}" for p in BREAKDOWN))
    for c in levels:
        for mode in modes:
            _, latencies, delta = closed[mode][c]
            row = breakdown(latencies, delta)
            print(f"{mode + f', c={c}':<26}" + "".join(f"{row[p]:>9.1f}" for p in BREAKDOWN))
    print(
        f"open loop: {len(arrivals)} Poisson arrivals at {0.8 * peak:.1f}/s "
        f"(80% of the request peak {peak:.1f})"
    )
    for mode in modes:
        p50, p99 = (1000 * percentile(opened[mode], q) for q in (0.5, 0.99))
        print(f"{mode:<26} p50 {p50:>7.0f} ms   p99 {p99:>7.0f} ms")
    print(
        f"priority run: one request a second for {args.priority_seconds:.0f} s under {max(levels)} "
        f"saturating clients (the {LOOP} server: those at priority 1, the timed ones at 0; the others FCFS)"
    )
    for mode in modes:
        alone, loaded = prioritized[mode]
        ratio = statistics.median(loaded) / statistics.median(alone)
        print(
            f"{mode:<26} alone p50 {1000 * statistics.median(alone):>6.0f} ms   under load p50 "
            f"{1000 * statistics.median(loaded):>6.0f} ms  p99 {1000 * percentile(loaded, 0.99):>6.0f} ms"
            f"   {ratio:.2f}x alone"
        )
    if args.bagel_images:
        bagel_dit_stage(args)
    c16 = 16 if 16 in levels else levels[-1]
    first = modes[2]
    ratio = closed[first][c16][0] / closed[PREVIOUS][c16][0]
    p99 = percentile(opened[first], 0.99) / percentile(opened[PREVIOUS], 0.99)
    print(
        f"targets ({first}): >= 1.15x previous at c={c16}: {ratio:.2f}x; "
        f"Poisson p99 <= 0.6x previous: {p99:.2f}x"
    )
    every = "  ".join(f"c={c} {closed[LOOP][c][0] / closed[PREVIOUS][c][0]:.2f}x" for c in levels)
    p99 = percentile(opened[LOOP], 0.99) / percentile(opened[PREVIOUS], 0.99)
    alone, loaded = prioritized[LOOP]
    print(
        f"targets ({LOOP}): >= 1.0x previous at every concurrency: {every}; >= 1.3x at c={c16}; "
        f"Poisson p99 <= 0.5x previous: {p99:.2f}x; priority under load <= 1.5x alone: "
        f"{statistics.median(loaded) / statistics.median(alone):.2f}x"
    )
    beside = "  ".join(f"c={c} {closed[BESIDE][c][0] / closed[LOOP][c][0]:.2f}x" for c in levels)
    p99 = percentile(opened[BESIDE], 0.99) / percentile(opened[LOOP], 0.99)
    print(f"{BESIDE}: images/s against the loop's default: {beside}; Poisson p99 {p99:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
