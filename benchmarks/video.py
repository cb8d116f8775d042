"""Wan text-to-video served at OpenAI's Videos API vs diffusers' own ``WanPipeline`` called in a loop, in one
run: the tiny Wan (random weights, the real architecture), 48x64, ``--frames`` frames, ``--steps`` steps
(guidance: the pipeline's default 5.0, so classifier-free guidance is on).

    python benchmarks/video.py [--videos 8] [--frames 17] [--steps 8] [--concurrency 1 4]

Baseline: diffusers' ``WanPipeline`` called once per video, one after the other, each video encoded as the
server encodes it (H.264 MP4, ``video_codec.encode_mp4``): what a service built on diffusers alone does.
Then the server (``vllm serve --omni``, its default batching: the step loop) with 1 and 4 videos in
flight, each through the Videos API as a client uses it: ``POST /v1/videos``, polling ``GET
/v1/videos/{id}`` every 20 ms until completed, ``GET .../content``. Both sides have the same threads (one
per process, ``OMP_NUM_THREADS=1``). Each figure is the median of ``--rounds`` timed rounds after a warm-up;
ratios are videos/s against the baseline.

Targets: >= 1.0x the baseline at concurrency 1, >= 1.5x at concurrency 4.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
HEIGHT, WIDTH, FPS = 48, 64, 16
TARGETS = {1: 1.0, 4: 1.5}
POLL_S = 0.02


def prompt(i: int) -> str:
    return f"a paper boat drifting down a rainy street, shot {i}"


class DiffusersLoop:
    """``WanPipeline`` called once per video, each encoded as MP4: what a service on diffusers alone does."""

    def __init__(self, model: str, frames: int, steps: int) -> None:
        import torch
        from diffusers import WanPipeline

        torch.set_num_threads(1)
        self.pipe = WanPipeline.from_pretrained(model)
        self.pipe.set_progress_bar_config(disable=True)
        self.frames, self.steps = frames, steps
        self.one(0)  # warm-up

    def one(self, i: int) -> None:
        import torch

        from vllm_omni_plugin.entrypoints.video_codec import encode_mp4

        out = self.pipe(
            prompt=prompt(i), height=HEIGHT, width=WIDTH, num_frames=self.frames,
            num_inference_steps=self.steps, generator=[torch.Generator().manual_seed(i)], output_type="np",
        )  # fmt: skip
        encode_mp4((out.frames[0] * 255).round().astype("uint8"), FPS)

    def rate(self, videos: int) -> float:
        start = time.perf_counter()
        for i in range(videos):
            self.one(i)
        return videos / (time.perf_counter() - start)


class VideosClient:
    """Videos through the API as a client makes them: create, poll every 20 ms, download."""

    def __init__(self, base_url: str, frames: int, steps: int) -> None:
        import httpx

        self.client = httpx.Client(base_url=base_url, timeout=600)
        self.frames, self.steps = frames, steps

    def one(self, i: int) -> None:
        body = {"prompt": prompt(i), "size": f"{WIDTH}x{HEIGHT}", "num_frames": self.frames,
                "num_inference_steps": self.steps, "seed": i, "fps": FPS}  # fmt: skip
        client = self.client
        job: dict[str, Any] = client.post("/v1/videos", json=body).raise_for_status().json()
        while job["status"] not in ("completed", "failed"):
            time.sleep(POLL_S)
            job = client.get(f"/v1/videos/{job['id']}").raise_for_status().json()
        if job["status"] != "completed":
            raise RuntimeError(f"video {job['id']} failed: {job['error']}")
        client.get(f"/v1/videos/{job['id']}/content").raise_for_status()
        client.delete(f"/v1/videos/{job['id']}")

    def rate(self, videos: int, concurrency: int) -> float:
        """Videos/s with ``concurrency`` videos in flight."""
        with ThreadPoolExecutor(concurrency) as pool:
            start = time.perf_counter()
            list(pool.map(self.one, range(videos)))
            return videos / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--videos", type=int, default=8, help="videos per timed round")
    parser.add_argument("--frames", type=int, default=17, help="frames per video (4k+1)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    from vllm_omni_plugin.tiny_models import build
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

    model = str(build("wan", ROOT / ".cache" / "tiny_models" / "wan"))
    levels = sorted(args.concurrency)
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as videos_dir:
        port = free_port()
        argv = [bin_script("vllm"), "serve", model, "--omni", "--host", "127.0.0.1", "--port", str(port),
                "--video-dir", videos_dir]  # fmt: skip
        log = ROOT / "out" / "bench_video_server.log"
        with ServerProcess(argv, port=port, log_path=log, env=cpu_test_env()) as server:
            server.wait_ready(timeout=600)
            baseline = DiffusersLoop(model, args.frames, args.steps)
            served = VideosClient(server.base_url, args.frames, args.steps)
            for concurrency in levels:
                served.rate(concurrency, concurrency)  # warm-up
            # Rounds interleave the sides, so what else the machine does weighs on both alike.
            for _ in range(args.rounds):
                rates.setdefault("diffusers", []).append(baseline.rate(args.videos))
                for concurrency in levels:
                    rates.setdefault(f"c{concurrency}", []).append(served.rate(args.videos, concurrency))
    base = statistics.median(rates["diffusers"])
    print(
        f"\ntiny Wan {WIDTH}x{HEIGHT}, {args.frames} frames, {args.steps} steps, guidance 5.0; "
        f"{args.videos} videos/round, {args.rounds} rounds (median)"
    )
    print(f"{'runner':<40} {'videos/s':>9} {'x diffusers':>12} {'target':>7}")
    print(f"{'diffusers WanPipeline, one call a video':<40} {base:>9.3f} {1.0:>12.2f}")
    for concurrency in levels:
        rate = statistics.median(rates[f"c{concurrency}"])
        target = TARGETS.get(concurrency)
        mark = f">= {target}" if target is not None else ""
        name = f"Videos API, concurrency {concurrency}"
        print(f"{name:<40} {rate:>9.3f} {rate / base:>12.2f} {mark:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
