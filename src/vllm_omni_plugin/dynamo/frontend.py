"""``python -m vllm_omni_plugin.dynamo.frontend``: Dynamo's OpenAI HTTP frontend, started as ``python -m
dynamo.frontend`` starts it (``make_engine`` and ``run_input`` of ``dynamo.llm``: the Rust service that
discovers workers and routes to them), for environments with only ``ai-dynamo-runtime`` installed (the
``ai-dynamo`` launcher brings dependencies a CPU host may not install). Flags and ``DYN_*`` defaults are
the launcher's, for the few this needs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_omni_plugin.dynamo.frontend",
        description="Dynamo's OpenAI HTTP frontend (the Rust service of `python -m dynamo.frontend`).",
    )
    parser.add_argument("--http-host", default=os.environ.get("DYN_HTTP_HOST", "0.0.0.0"))
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("DYN_HTTP_PORT", "8000")))
    parser.add_argument(
        "--namespace",
        default=os.environ.get("DYN_NAMESPACE"),
        help="Discover models of this namespace only (default: every namespace).",
    )
    parser.add_argument(
        "--discovery-backend",
        default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
        choices=("kubernetes", "etcd", "file", "mem"),
    )
    parser.add_argument(
        "--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"), choices=("tcp", "nats")
    )
    parser.add_argument(
        "--event-plane", default=os.environ.get("DYN_EVENT_PLANE"), choices=("zmq", "nats"), type=str
    )
    parser.add_argument(
        "--router-mode",
        default=os.environ.get("DYN_ROUTER_MODE", "round-robin"),
        choices=("round-robin", "random"),
    )
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    import signal

    from dynamo.llm import EngineType, EntrypointArgs, RouterConfig, RouterMode, make_engine, run_input
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, runtime.shutdown)
    mode = RouterMode.Random if args.router_mode == "random" else RouterMode.RoundRobin
    kwargs = {"http_host": args.http_host, "http_port": args.http_port, "router_config": RouterConfig(mode)}
    if args.namespace:
        kwargs["namespace"] = args.namespace
    engine = await make_engine(runtime, EntrypointArgs(EngineType.Dynamic, **kwargs))
    await run_input(runtime, "http", engine)


def main(argv: list[str] | None = None) -> None:
    from vllm_omni_plugin.dynamo.runtime import DynamoSetupError, require_dynamo

    try:
        require_dynamo()
    except DynamoSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
