"""Soak a served deployment: a mix of text-to-image, edits, bad requests and client disconnects at a given
concurrency for N requests, with stage kills; reports outcomes by kind, latency p50/p99, the RSS of every
process of the deployment at the start, middle and end, and the /dev/shm segments it holds.

    python benchmarks/soak.py [--model DIR] [--requests 2000] [--concurrency 8] [--kill-every 500]
    python benchmarks/soak.py --url http://HOST:PORT --pid MAIN_PID --served-model-name NAME ...

Without --url it serves the tiny GLM-Image (`vllm serve --omni`, deploy/tiny_glm_image_cpu.yaml) and stops
it afterwards. Kills alternate between the diffusion process and the AR engine core. Exit code 1 when a
request had an unexpected outcome, the deployment holds more segments at the end than at the start (pool
capacity, which fills to the mix's working set, and values in flight aside), or values nobody collected.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = str(ROOT / "deploy" / "tiny_glm_image_cpu.yaml")
MODEL_NAME = "tiny-glm-image"


def kill_plan(requests: int, every: int | None, kills: list[str]) -> dict[int, str]:
    """Request index -> stage to kill: ``--kills 75:dit,120:ar``, else every ``every`` requests
    alternating dit/ar, else one kill of the diffusion process in the middle."""
    if kills:
        plan = {}
        for item in kills:
            at, _, stage = item.partition(":")
            plan[int(at)] = stage or "dit"
        return plan
    if every:
        return {at: ("dit", "ar")[n % 2] for n, at in enumerate(range(every, requests, every))}
    return {requests // 2: "dit"}


def main() -> int:
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, free_port
    from vllm_omni_testkit.harness.soak import Deployment, SoakSettings, run_soak

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: build the tiny GLM-Image)")
    parser.add_argument("--url", default=None, help="soak a running server instead of starting one")
    parser.add_argument("--pid", type=int, default=None, help="with --url: the server's main process")
    parser.add_argument("--served-model-name", default=MODEL_NAME)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-every", type=int, default=None, help="kill a stage every N requests")
    parser.add_argument("--kills", default="", help="explicit kills: 75:dit,120:ar (none: 'none')")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sample-every", type=int, default=None, help="also sample every N requests")
    args = parser.parse_args()

    kills = (
        {}
        if args.kills == "none"
        else kill_plan(args.requests, args.kill_every, [k for k in args.kills.split(",") if k])
    )
    settings = SoakSettings(
        requests=args.requests,
        concurrency=args.concurrency,
        kills=kills,
        size=args.size,
        steps=args.steps,
        sample_every=args.sample_every,
    )
    server = None
    if args.url:
        if args.pid is None:
            parser.error("--url needs --pid (the server's main process, for its RSS and segments)")
        deployment = Deployment(args.url, args.pid, args.served_model_name)
    else:
        model = args.model
        if model is None:
            from vllm_omni_plugin.tiny_models import build

            model = str(build("glm-image", ROOT / ".cache" / "tiny_models" / "glm-image"))
        port = free_port()
        log = Path(tempfile.mkdtemp(prefix="omni-soak-")) / "server.log"
        server = ServerProcess(
            [bin_script("vllm"), "serve", model, "--omni", "--deploy-config", DEPLOY, "--port", str(port),
             "--host", "127.0.0.1", "--served-model-name", args.served_model_name, "--disable-log-stats"],
            port=port, log_path=log,
        )  # fmt: skip
        server.start()
        server.wait_ready(timeout=600)
        assert server.proc is not None
        print(f"server log: {log}", file=sys.stderr)
        deployment = Deployment(server.base_url, server.proc.pid, args.served_model_name)
    try:
        report = run_soak(deployment, settings)
    finally:
        if server is not None:
            server.stop()
    print(report.format())
    return 1 if report.unexpected or report.segment_growth > 0 or report.uncollected_values else 0


if __name__ == "__main__":
    sys.exit(main())
