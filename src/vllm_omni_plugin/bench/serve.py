"""``vllm bench serve --omni``: vLLM's serving benchmark for image servers.

The same command and flags as ``vllm bench serve`` where they mean the same thing (``--base-url`` or
``--host``/``--port``, ``--model``, ``--num-prompts``, ``--request-rate``, ``--burstiness``,
``--max-concurrency``, ``--seed``, ``--save-result``, ``--result-dir``, ``--result-filename``,
``--percentile-metrics``, ``--metric-percentiles``, ``--goodput``, ``--metadata``), with image workloads
instead of token ones: text to image (``generations``), edits of generated source images (``edits``),
chat with image output (``chat``) and streamed generations (``stream``: time to the first preview). Prompts
are drawn at random (seeded) or read from a file, sizes and step counts from the lists given. It reports
requests/s, images/s and latency statistics, and, where the server exports ours, queue and per-stage
times read from ``/metrics``; ``--save-result`` writes vLLM's result JSON. It speaks OpenAI's Images API
only, so it measures any OpenAI-compatible image server (vllm-omni's included).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

WORKLOADS = ("generations", "edits", "chat", "stream")
PERCENTILE_METRICS = ("e2el", "ttfp")
"""Latency end to end, and time to the first preview (``stream`` only)."""
WORDS = (
    "a red fox, a lighthouse, an old bridge, a mountain lake, a city street, a paper boat, a forest path, "
    "a bowl of fruit, a sleeping cat, a sailing ship, a desert road, a glass vase, a snowy village, a "
    "robot, a garden, a violin, a waterfall, a bicycle, a castle, a tiger"
).split(", ")
STYLES = ("at dusk", "in the rain", "as a watercolor", "in morning light", "as an oil painting", "at night")


class BenchError(Exception):
    """A user-caused problem (bad flags, an unreachable server): one line, no traceback."""


@dataclass(frozen=True)
class ImageAsk:
    """One request of the benchmark, drawn before it starts (so a seed gives the same workload)."""

    index: int
    prompt: str
    size: str
    steps: int | None
    seed: int


@dataclass
class Outcome:
    success: bool = False
    latency: float = 0.0
    """Seconds from sending to the full answer."""
    ttfp: float | None = None
    """Seconds to the first preview (streamed requests)."""
    start_time: float = 0.0
    queue_time: float = 0.0
    """Seconds it waited for a place under ``--max-concurrency`` before it was sent."""
    images: int = 0
    error: str = ""


@dataclass
class ServerMetrics:
    """Sums of the server's ``/metrics`` samples by name (with the label values that matter)."""

    samples: dict[str, float] = field(default_factory=dict)

    def delta(self, before: ServerMetrics, name: str) -> float:
        return self.samples.get(name, 0.0) - before.samples.get(name, 0.0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm bench serve --omni",
        description="Benchmark an OpenAI-compatible image server (vllm serve --omni, vllm-omni, ...).",
    )
    parser.add_argument("--omni", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="Model name (default: the server's first model)")
    parser.add_argument("--workload", choices=WORKLOADS, default="generations")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--num-warmups", type=int, default=0, help="Requests sent first and not measured")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Requests/s (inf: all at once)"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset-name", choices=("random", "prompts"), default="random")
    parser.add_argument(
        "--dataset-path", default=None, help="Prompts file (one per line, or JSONL with prompt)"
    )
    parser.add_argument("--size", default="1024x1024", help="Sizes drawn uniformly, e.g. 512x512,1024x1024")
    parser.add_argument("--num-inference-steps", default=None, help="Step counts drawn uniformly, e.g. 4,8")
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--n", type=int, default=1, help="Images per request")
    parser.add_argument("--extra-body", default=None, help="JSON object added to every request body")
    parser.add_argument("--percentile-metrics", default=None, help="Of e2el, ttfp (default: e2el[,ttfp])")
    parser.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    parser.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. e2el:2000 ttfp:500")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--save-detailed", action="store_true", help="Keep every request's numbers")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--label", default=None)
    parser.add_argument("--metadata", nargs="*", default=None, help="KEY=VALUE pairs saved with the result")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds one request may take")
    parser.add_argument("--ready-check-timeout-sec", type=float, default=0.0, help="Wait for the server")
    parser.add_argument("--disable-tqdm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.num_warmups < 0:
        raise BenchError(f"--num-warmups must be 0 or more, got {args.num_warmups}")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise BenchError(f"--burstiness must be positive, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not 1 <= args.n <= 10:
        raise BenchError(f"--n must be 1 to 10 (OpenAI's range), got {args.n}")
    args.sizes = [s.strip() for s in args.size.split(",") if s.strip()]
    for size in args.sizes:
        width, _, height = size.partition("x")
        if not (width.isdigit() and height.isdigit()):
            raise BenchError(f"--size {size!r}: expected WIDTHxHEIGHT, e.g. 1024x1024")
    args.step_counts = [None]
    if args.num_inference_steps:
        try:
            args.step_counts = [int(s) for s in args.num_inference_steps.split(",")]
        except ValueError:
            raise BenchError(
                f"--num-inference-steps {args.num_inference_steps!r}: expected e.g. 4 or 4,8"
            ) from None
    args.extra = {}
    if args.extra_body:
        try:
            args.extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise BenchError(f"--extra-body is not JSON: {exc.msg}") from None
        if not isinstance(args.extra, dict):
            raise BenchError("--extra-body must be a JSON object")
    default_metrics = "e2el,ttfp" if args.workload == "stream" else "e2el"
    args.metrics = [m.strip() for m in (args.percentile_metrics or default_metrics).split(",") if m.strip()]
    for metric in args.metrics:
        if metric not in PERCENTILE_METRICS:
            raise BenchError(
                f"--percentile-metrics: {metric!r} is not one of {', '.join(PERCENTILE_METRICS)}"
            )
    try:
        args.percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise BenchError(f"--metric-percentiles {args.metric_percentiles!r}: expected e.g. 50,99") from None
    args.slos = {}
    for item in args.goodput or []:
        name, _, value = item.partition(":")
        try:
            args.slos[name] = float(value)
        except ValueError:
            raise BenchError(f"--goodput {item!r}: expected METRIC:MILLISECONDS, e.g. e2el:2000") from None
        if name not in PERCENTILE_METRICS:
            raise BenchError(f"--goodput {item!r}: {name!r} is not one of {', '.join(PERCENTILE_METRICS)}")
    if args.dataset_name == "prompts" and not args.dataset_path:
        raise BenchError("--dataset-name prompts needs --dataset-path FILE")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def read_prompts(path: str) -> list[str]:
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise BenchError(f"--dataset-path {path}: {exc.strerror}") from None
    prompts = []
    for line in lines:
        if line.startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise BenchError(
                    f"--dataset-path {path}: a JSON line without a prompt: {line[:80]}"
                ) from None
        else:
            prompts.append(line)
    if not prompts:
        raise BenchError(f"--dataset-path {path}: no prompts in it")
    return prompts


def draw_requests(args: argparse.Namespace) -> list[ImageAsk]:
    """The workload, drawn from ``--seed``: prompts, sizes and step counts uniformly from their lists."""
    rng = random.Random(args.seed)
    prompts = read_prompts(args.dataset_path) if args.dataset_name == "prompts" else None
    asks = []
    for index in range(args.num_prompts):
        if prompts is not None:
            prompt = prompts[index % len(prompts)]
        else:
            prompt = f"{rng.choice(WORDS)} {rng.choice(STYLES)}"
        asks.append(
            ImageAsk(index, prompt, rng.choice(args.sizes), rng.choice(args.step_counts), args.seed + index)
        )
    return asks


def source_png(size: str, seed: int) -> bytes:
    """A source image for edits: smooth random colours, the request's size."""
    import numpy as np
    from PIL import Image

    width, height = (int(v) for v in size.split("x"))
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, height // 8), max(1, width // 8), 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def body_of(args: argparse.Namespace, ask: ImageAsk) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": ask.prompt, "size": ask.size, "n": args.n, "seed": ask.seed}
    if args.model:
        body["model"] = args.model
    if ask.steps is not None:
        body["num_inference_steps"] = ask.steps
    if args.guidance_scale is not None:
        body["guidance_scale"] = args.guidance_scale
    return {**body, **args.extra}


async def send(client: Any, args: argparse.Namespace, ask: ImageAsk) -> Outcome:
    """One request; its outcome (an error is the server's answer, not an exception)."""
    import httpx

    body, outcome = body_of(args, ask), Outcome()
    start = time.perf_counter()
    outcome.start_time = time.time()
    try:
        if args.workload == "stream":
            await _stream(client, args, body, outcome, start)
        else:
            if args.workload == "generations":
                response = await client.post("/v1/images/generations", json=body)
            elif args.workload == "edits":
                files = {"image": ("source.png", source_png(ask.size, ask.seed), "image/png")}
                fields = {
                    k: (json.dumps(v) if isinstance(v, dict | list) else str(v)) for k, v in body.items()
                }
                response = await client.post("/v1/images/edits", data=fields, files=files)
            else:
                chat = {k: v for k, v in body.items() if k not in ("prompt", "n")}
                chat |= {"messages": [{"role": "user", "content": ask.prompt}], "modalities": ["image"]}
                response = await client.post("/v1/chat/completions", json=chat)
            outcome.latency = time.perf_counter() - start
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return outcome
            answer = response.json()
            if args.workload == "chat":
                content = answer["choices"][0]["message"]["content"]
                parts = content if isinstance(content, list) else []
                outcome.images = sum(1 for p in parts if p.get("type") == "image_url")
            else:
                outcome.images = len(answer.get("data", []))
            outcome.success = outcome.images > 0
            if not outcome.success:
                outcome.error = "the answer carries no image"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, IndexError) as exc:
        outcome.latency = time.perf_counter() - start
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def _stream(
    client: Any, args: argparse.Namespace, body: dict[str, Any], outcome: Outcome, start: float
) -> None:
    body = {**body, "stream": True, "partial_images": body.get("partial_images", 1), "n": 1}
    async with client.stream("POST", "/v1/images/generations", json=body) as response:
        if response.status_code != 200:
            outcome.latency = time.perf_counter() - start
            outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:].strip())
            kind = str(event.get("type", ""))
            if kind.endswith(".partial_image") and outcome.ttfp is None:
                outcome.ttfp = time.perf_counter() - start
            elif kind.endswith(".completed"):
                outcome.images += 1
            elif kind == "error" or "error" in event:
                outcome.error = str(event.get("error", event))[:200]
    outcome.latency = time.perf_counter() - start
    outcome.success = outcome.images > 0 and not outcome.error


async def read_server_metrics(client: Any) -> ServerMetrics | None:
    """The server's ``/metrics`` where it exports ours (None for a server that has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get("/metrics")
    except Exception:  # a server without /metrics: the server-side numbers are left out
        return None
    if response.status_code != 200 or "omni_" not in response.text:
        return None
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if not sample.name.startswith("omni_"):
                continue
            key = sample.name
            if sample.name.startswith("omni_stage_latency_seconds_") and "stage" in sample.labels:
                key = f"{sample.name}[{sample.labels['stage']}:{sample.labels.get('name', '')}]"
            samples[key] = samples.get(key, 0.0) + float(sample.value)
    return ServerMetrics(samples)


async def first_model(client: Any) -> str | None:
    response = await client.get("/v1/models")
    if response.status_code != 200:
        return None
    data = response.json().get("data") or []
    return str(data[0]["id"]) if data else None


async def wait_ready(client: Any, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await client.get("/v1/models")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise BenchError(f"the server did not answer /v1/models within {timeout:g} s")
        await asyncio.sleep(1.0)


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request, as vLLM draws them: gamma-distributed gaps of mean ``1 / rate`` (shape
    ``burstiness``: 1 is a Poisson process); all at once at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(count)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=args.timeout, headers=headers, limits=limits
    ) as client:
        if args.ready_check_timeout_sec > 0:
            await wait_ready(client, args.ready_check_timeout_sec)
        try:
            served = await first_model(client)
        except httpx.HTTPError as exc:
            raise BenchError(f"cannot reach {args.base_url}: {type(exc).__name__}: {exc}") from None
        args.model = args.model or served
        asks = draw_requests(args)
        if args.num_warmups:  # the workload's first requests, one after another, not counted
            warm = [await send(client, args, ask) for ask in asks[: args.num_warmups]]
            failed = [o.error for o in warm if not o.success]
            if failed:
                raise BenchError(f"a warm-up request failed: {failed[0]}")
        before = await read_server_metrics(client)
        slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        in_flight, most = 0, 0

        async def one(ask: ImageAsk) -> Outcome:
            nonlocal in_flight, most
            waited = time.perf_counter()
            if slots is not None:
                await slots.acquire()
            queued = time.perf_counter() - waited
            in_flight += 1
            most = max(most, in_flight)
            try:
                outcome = await send(client, args, ask)
            finally:
                in_flight -= 1
                if slots is not None:
                    slots.release()
            outcome.queue_time = queued
            return outcome

        start = time.perf_counter()
        tasks = []
        for ask, gap in zip(
            asks, arrival_gaps(len(asks), args.request_rate, args.burstiness, args.seed), strict=True
        ):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(ask)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await read_server_metrics(client)
    result = summarize(args, asks, outcomes, duration, most)
    if before is not None and after is not None:
        result["server"] = server_side(before, after)
    return result


def _stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    import numpy as np

    ms = [v * 1000 for v in values] or [0.0]
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(
    args: argparse.Namespace, asks: list[ImageAsk], outcomes: list[Outcome], duration: float, most: int
) -> dict[str, Any]:
    """vLLM's result shape, with images where it has tokens."""
    done = [o for o in outcomes if o.success]
    images = sum(o.images for o in done)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-images",
        "backend": "openai-images",
        "workload": args.workload,
        "label": args.label,
        "model_id": args.model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_images": images,
        "request_throughput": len(done) / duration if duration else 0.0,
        "image_throughput": images / duration if duration else 0.0,
        "max_concurrent_requests": most,
    }
    for key, value in (item.split("=", 1) for item in args.metadata or [] if "=" in item):
        result[key.strip()] = value.strip()
    if args.slos:
        good = [o for o in done if all(_meets(o, name, ms) for name, ms in args.slos.items())]
        result["request_goodput"] = len(good) / duration if duration else 0.0
    series = {"e2el": [o.latency for o in done], "ttfp": [o.ttfp for o in done if o.ttfp is not None]}
    for metric in args.metrics:
        result.update(_stats(metric, series[metric], args.percentiles))
    result["requests"] = [
        {"prompt": a.prompt, "size": a.size, "num_inference_steps": a.steps, "seed": a.seed} for a in asks
    ]
    result |= {
        "latencies": [o.latency for o in outcomes],
        "ttfps": [o.ttfp for o in outcomes],
        "start_times": [o.start_time for o in outcomes],
        "queue_times": [o.queue_time for o in outcomes],
        "images": [o.images for o in outcomes],
        "errors": [o.error for o in outcomes],
    }
    return result


def _meets(outcome: Outcome, metric: str, limit_ms: float) -> bool:
    value = outcome.latency if metric == "e2el" else outcome.ttfp
    return value is not None and value * 1000 <= limit_ms


def server_side(before: ServerMetrics, after: ServerMetrics) -> dict[str, float]:
    """What the server spent, from its ``/metrics`` (ours): queue wait per diffusion request and the mean
    time a request spent in each stage over the run."""
    out: dict[str, float] = {}
    started = after.delta(before, "omni_diffusion_started_requests_total")
    if started:
        out["mean_diffusion_queue_ms"] = (
            1000 * after.delta(before, "omni_diffusion_queue_wait_seconds_total") / started
        )
        out["diffusion_requests"] = started
    for key in after.samples:
        if key.startswith("omni_stage_latency_seconds_sum["):
            stage = key[key.index("[") + 1 : -1]
            count = after.delta(before, key.replace("_sum[", "_count["))
            if count:
                out[f"mean_stage_{stage}_ms"] = 1000 * after.delta(before, key) / count
    return out


def print_report(result: dict[str, Any]) -> None:
    line = "{:<40} {:<10}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result (images) ", n=56, c="="))
    for label, key in (
        ("Successful requests:", "completed"),
        ("Failed requests:", "failed"),
        ("Maximum request concurrency:", "max_concurrency"),
        ("Benchmark duration (s):", "duration"),
        ("Total images:", "total_images"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Image throughput (images/s):", "image_throughput"),
        ("Request goodput (req/s):", "request_goodput"),
    ):
        if key in result:
            value = result[key]
            print(line.format(label, f"{value:.2f}" if isinstance(value, float) else str(value)))
    for metric, title in (("e2el", "End-to-end Latency"), ("ttfp", "Time to First Preview")):
        keys = [k for k in result if k.endswith(f"_{metric}_ms")]
        if keys:
            print("{s:{c}^{n}}".format(s=title, n=56, c="-"))
            for key in keys:
                name = key.removesuffix(f"_{metric}_ms")
                label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(name, name.upper())
                print(line.format(f"{label} {metric.upper()} (ms):", f"{result[key]:.2f}"))
    server = result.get("server")
    if server:
        print("{s:{c}^{n}}".format(s="Server (/metrics)", n=56, c="-"))
        for key, value in server.items():
            print(line.format(f"{key}:", f"{value:.2f}"))
    print("=" * 56)


def save(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    saved = dict(result)
    if not args.save_detailed:
        for key in ("latencies", "ttfps", "start_times", "queue_times", "images", "errors"):
            saved.pop(key, None)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = str(args.model or "model").split("/")[-1]
    name = (
        args.result_filename
        or f"{args.label or 'omni-images'}-{rate}qps{concurrency}-{model}-{result['date']}.json"
    )
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved))
    return path


def measure(argv: list[str]) -> dict[str, Any]:
    """One run from Python (the benchmarks under ``benchmarks/``): the flags as on the command line, the
    result as ``--save-result`` saves it (nothing printed)."""
    return asyncio.run(run(parse_args(argv)))


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
        result = asyncio.run(run(args))
        print_report(result)
        if args.save_result:
            print(f"saved {save(args, result)}")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0 if result["completed"] else 1
