"""``python -m vllm_omni_plugin.dynamo MODEL --deploy-config F.yaml [role] [Dynamo flags]``: a worker
that NVIDIA Dynamo's frontend discovers.

The command line is ``vllm serve --omni``'s (vLLM's serve flags, which apply to the AR stages, and the
Omni group: deploy files and legacy ``--stage-configs-path`` documents alike) plus Dynamo's runtime
flags, named and defaulted as Dynamo's own workers have them (``--namespace``, ``--endpoint``,
``--discovery-backend``, ``--request-plane``, ``--event-plane``, each from its ``DYN_*`` variable). The
role: the whole pipeline in this process (default), ``--omni-router`` (the orchestrator, every stage on
Dynamo stage workers) or ``--stage-id N`` (one stage's worker). Every mistake a user can make here is one
``error:`` line and exit code 2; a stage that cannot start is one line and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any, NoReturn

PROG = "python -m vllm_omni_plugin.dynamo"
DYNAMO_GROUP_TITLE = "Dynamo"
EXIT_USAGE = 2
EXIT_FAILURE = 1


class DynamoCLIError(Exception):
    """A user-caused problem on the command line: one line, exit code 2."""


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(name) or default


def add_dynamo_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        DYNAMO_GROUP_TITLE,
        description="Serving under NVIDIA Dynamo: where this worker registers and how it reaches the "
        "frontend and the other workers (defaults from the DYN_* variables, as in Dynamo's own workers).",
    )
    group.add_argument(
        "--namespace",
        default=_env("DYN_NAMESPACE", "dynamo"),
        help="Dynamo namespace (DYN_NAMESPACE; default dynamo).",
    )
    group.add_argument(
        "--endpoint",
        default=_env("DYN_ENDPOINT", None),
        metavar="dyn://NAMESPACE.COMPONENT.ENDPOINT",
        help="The endpoint the model is registered on (DYN_ENDPOINT; default "
        "dyn://NAMESPACE.backend.generate); stage workers serve COMPONENT-stageN.ENDPOINT of it.",
    )
    group.add_argument(
        "--discovery-backend",
        default=_env("DYN_DISCOVERY_BACKEND", "etcd"),
        choices=("kubernetes", "etcd", "file", "mem"),
        help="Dynamo discovery (DYN_DISCOVERY_BACKEND; default etcd, reached through ETCD_ENDPOINTS; file: "
        "the folder DYN_FILE_KV, shared by every process of one host).",
    )
    group.add_argument(
        "--request-plane",
        default=_env("DYN_REQUEST_PLANE", "tcp"),
        choices=("tcp", "nats"),
        help="How requests reach workers (DYN_REQUEST_PLANE; default tcp).",
    )
    group.add_argument(
        "--event-plane",
        default=_env("DYN_EVENT_PLANE", None),
        choices=("zmq", "nats"),
        help="How events are published (DYN_EVENT_PLANE; default: Dynamo's, zmq).",
    )
    group.add_argument(
        "--omni-router",
        action="store_true",
        default=False,
        help="Run the orchestrator and register the model, with every stage served by Dynamo stage workers "
        "(started with --stage-id N) found through discovery.",
    )


def build_parser() -> argparse.ArgumentParser:
    from vllm_omni_plugin import compat
    from vllm_omni_plugin.entrypoints.cli import add_omni_arguments

    parser = compat.FlexibleArgumentParser(
        prog=PROG,
        description="Serve an omni pipeline (or one of its stages) as a worker of NVIDIA Dynamo. vLLM's "
        "serve flags apply to the AR stages; the Omni group is `vllm serve --omni`'s.",
        usage=f"{PROG} MODEL [--deploy-config FILE | --stage-configs-path FILE] "
        "[--omni-router | --stage-id N] [options]",
    )
    compat.make_arg_parser(parser)
    add_omni_arguments(parser)
    add_dynamo_arguments(parser)
    parser.set_defaults(serve_defaults={a.dest: a.default for a in parser._actions})
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    from vllm_omni_plugin.entrypoints.cli import OmniCLIError, check_config_files, version_line

    args = build_parser().parse_args(argv)
    if getattr(args, "version", False) is True:
        print(version_line())
        sys.exit(0)
    try:
        check_config_files(args)
    except OmniCLIError as exc:
        raise DynamoCLIError(str(exc)) from None
    check_role_args(args)
    return args


def check_role_args(args: argparse.Namespace) -> None:
    """What a Dynamo worker refuses: flags of the other kinds of server, and contradicting roles."""
    if getattr(args, "headless", False) or args.head is not None:
        raise DynamoCLIError(
            "--headless and --head start a worker for a `vllm serve --omni` head; under Dynamo a stage's "
            "worker is --stage-id N (its router runs with --omni-router)"
        )
    if args.omni_router and args.stage_id is not None:
        raise DynamoCLIError(
            "--omni-router and --stage-id N are two roles; give one (or neither: the pipeline role)"
        )
    if args.image_media_dir:
        raise DynamoCLIError(
            "--image-media-dir is not served under Dynamo (the worker has no media route); images come back "
            "as b64_json"
        )
    if args.stage_id is not None and args.stage_id < 0:
        raise DynamoCLIError(f"--stage-id {args.stage_id}: expected a stage id (0, 1, ...)")
    if (args.omni_router or args.stage_id is not None) and args.worker_backend == "ray":
        raise DynamoCLIError(
            "--worker-backend ray places the stages on a Ray cluster; with --omni-router and --stage-id the "
            "stages are Dynamo stage workers (run the pipeline role for Ray)"
        )
    dynamo_settings(args)


def dynamo_settings(args: argparse.Namespace) -> Any:
    from vllm_omni_plugin.dynamo.runtime import DynamoSettings

    namespace, component, endpoint = args.namespace, "backend", "generate"
    if args.endpoint:
        parts = args.endpoint.removeprefix("dyn://").split(".")
        if len(parts) != 3 or not all(parts):
            raise DynamoCLIError(
                f"--endpoint {args.endpoint!r}: expected dyn://NAMESPACE.COMPONENT.ENDPOINT, e.g. "
                "dyn://dynamo.backend.generate"
            )
        namespace, component, endpoint = parts
    return DynamoSettings(
        namespace=namespace,
        component=component,
        endpoint=endpoint,
        discovery_backend=args.discovery_backend,
        request_plane=args.request_plane,
        event_plane=args.event_plane,
    )


def run(args: argparse.Namespace) -> int:
    from vllm_omni_plugin.entrypoints.cli import resolve_for_serving
    from vllm_omni_plugin.log import get_logger

    logger = get_logger(__name__)

    resolved = resolve_for_serving(args)
    if args.omni_router or args.stage_id is not None:
        if resolved.backend == "ray":
            raise DynamoCLIError(
                "the deploy config's backend is ray; with --omni-router and --stage-id the stages are Dynamo "
                "stage workers (run the pipeline role for Ray)"
            )
        if headless := [s.stage_id for s in resolved.stages if s.headless]:
            logger.info(
                "stage(s) %s are marked headless: under Dynamo, their stage workers serve them", headless
            )
    if not os.path.isdir(resolved.model):
        raise DynamoCLIError(f"model directory {resolved.model!r} does not exist")
    settings = dynamo_settings(args)
    _configure_logging(args)
    if args.stage_id is not None:
        stage = next((s for s in resolved.stages if s.stage_id == args.stage_id), None)
        if stage is None:
            ids = ", ".join(str(s.stage_id) for s in resolved.stages)
            raise DynamoCLIError(
                f"--stage-id {args.stage_id}: the pipeline has no such stage (stages: {ids})"
            )
        from vllm_omni_plugin.dynamo.roles import serve_stage

        return asyncio.run(serve_stage(resolved, args.stage_id, settings))
    from vllm_omni_plugin.dynamo.roles import serve_model

    return asyncio.run(serve_model(args, resolved, settings, router=args.omni_router))


def _configure_logging(args: argparse.Namespace) -> None:
    """vLLM's logging configured from the arguments, as ``vllm serve`` does (a failure is logged)."""
    from vllm_omni_plugin import compat
    from vllm_omni_plugin.log import best_effort

    with best_effort("configuring vLLM's logging from the arguments"):
        compat.configure_logging_from_args(args)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from vllm_omni_plugin.dynamo.runtime import DynamoSetupError, require_dynamo

    try:
        require_dynamo()
    except DynamoSetupError as exc:
        fail(str(exc))
    from vllm_omni_plugin.compat import CompatImportError
    from vllm_omni_plugin.config.errors import ConfigError
    from vllm_omni_plugin.entrypoints.cli import OmniCLIError, check_plugin_enabled, version_line
    from vllm_omni_plugin.stage.errors import StagePlacementError, StageStartError

    try:
        check_plugin_enabled()
        from vllm_omni_plugin import compat

        compat.cli_env_setup()
        args = parse_args(argv)
        sys.exit(run(args))
    except CompatImportError as exc:
        fail(f"{exc}; {version_line()}", EXIT_FAILURE)
    except (DynamoCLIError, OmniCLIError, ConfigError, StagePlacementError) as exc:
        fail(str(exc))
    except (StageStartError, DynamoSetupError) as exc:  # not a usage error: exit 1, still one line
        fail(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        sys.exit(130)
