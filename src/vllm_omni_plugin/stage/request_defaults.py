"""What a request gets for what it leaves unset, and the sizes the deployment can make: resolved once and
applied to every request before its first stage runs, so routes and processors never fill a default.

- The size: the deploy config's (which carries the pipeline family's defaults), else the model's own
  pipeline's as its diffusion stage loaded it (``StageReady.runner_defaults``).
- The step count: the deploy config's; where it sets none, the diffusion runner's own default applies
  in the stage (for BAGEL, the authors' default for the request's mode).
- The pipeline's own generation settings (``Pipeline.setting_names``, e.g. BAGEL's ``cfg_*`` and
  ``think``): the diffusion stage's ``default_sampling_params`` under the request's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_omni_plugin.config.pipeline import get_pipeline
from vllm_omni_plugin.config.resolved import ResolvedDeployment
from vllm_omni_plugin.diffusion.runner import ServedDefaults, SizeLimits
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

if TYPE_CHECKING:
    from vllm_omni_plugin.stage.orchestrator import OmniRequest


@dataclass(frozen=True)
class SizeDefaults:
    """What a request of this deployment gets for an unset size, and what sizes its model can make."""

    height: int | None
    width: int | None
    limits: SizeLimits
    made_by: str
    """Who states the limits, for messages (the runner and its model)."""

    def check(self, width: int, height: int) -> str | None:
        """Why the model cannot make ``width`` x ``height`` (None: it can)."""
        multiple, largest = self.limits.multiple, self.limits.max_side
        got = f"for {self.made_by}, got {width}x{height}"
        if width % multiple or height % multiple:
            return f"width and height must be multiples of {multiple} {got}"
        if largest is not None and (width > largest or height > largest):
            return f"width and height must be at most {largest} pixels {got}"
        return None


class DeploymentDefaults:
    """The deployment's request defaults: from its configuration at once; the sizes final (with the model's
    own pipeline) from the first ready replica of the diffusion stage that makes the image."""

    def __init__(self, deployment: ResolvedDeployment, pools: dict[int, StageReplicaPool]) -> None:
        dit = next(
            (s for s in deployment.stages if s.execution_type == "diffusion" and s.final_output),
            None,
        )
        self._pool = pools.get(dit.stage_id) if dit is not None else None
        args = dit.diffusion_args if dit is not None else {}
        self._configured = SizeDefaults(
            height=_int_or_none(args.get("height")),
            width=_int_or_none(args.get("width")),
            limits=SizeLimits(),
            made_by=deployment.pipeline,
        )
        self._resolved: SizeDefaults | None = None if self._pool is not None else self._configured
        pipeline = get_pipeline(deployment.pipeline)
        self._edits_keep_source_size = pipeline.edits_keep_source_size
        self.num_inference_steps = _int_or_none(args.get("num_inference_steps"))
        """The deploy config's step count (None: the runner's own default, applied in the stage)."""
        configured = dit.default_sampling_params if dit is not None else {}
        self.settings = {k: v for k, v in configured.items() if k in pipeline.setting_names}
        """The pipeline's own settings the deploy config gives (the diffusion stage's
        ``default_sampling_params``)."""

    @property
    def sizes(self) -> SizeDefaults:
        """Final once a replica has said what it makes (a headless stage's may join after start-up)."""
        if self._resolved is not None:
            return self._resolved
        served = self._pool.runner_defaults if self._pool is not None else None
        if served is None:
            return self._configured
        self._resolved = from_served(self._configured, served)
        return self._resolved

    def apply(self, request: OmniRequest) -> str | None:
        """Give ``request`` the defaults it leaves unset; why its model cannot make its size (None: it
        can)."""
        if request.num_inference_steps is None:
            request.num_inference_steps = self.num_inference_steps
        request.generation_params = {**self.settings, **request.generation_params}
        sizes = self.sizes
        if request.height is None:
            request.height = sizes.height
        if request.width is None:
            request.width = sizes.width
        if request.height is None or request.width is None:
            return None  # the model decides (e.g. a Qwen-Image edit, from its source's size)
        if request.images and self._edits_keep_source_size:
            return None  # the size asked for is not the size made
        return sizes.check(request.width, request.height)


def from_served(configured: SizeDefaults, served: ServedDefaults) -> SizeDefaults:
    """The replica's defaults already prefer the configuration's (``DiffusionEngine``): take them, and
    its model's limits."""
    return SizeDefaults(
        height=served.defaults.height or configured.height,
        width=served.defaults.width or configured.width,
        limits=served.limits,
        made_by=served.label or configured.made_by,
    )


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int | float | str) and str(value) else None


def request_size(request: OmniRequest, stage_id: int) -> tuple[int, int]:
    """(height, width) of a request the runtime has given its size (:meth:`DeploymentDefaults.apply`):
    stage-input processors read it here and fill nothing."""
    from vllm_omni_plugin.stage.errors import StageRequestError

    if request.height is None or request.width is None:
        raise StageRequestError(
            "the request has no size and the deployment states no default: give height and width",
            stage_id=stage_id,
            request_id=request.request_id,
        )
    return int(request.height), int(request.width)
