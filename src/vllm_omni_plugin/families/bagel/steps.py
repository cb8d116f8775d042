"""BAGEL's generation stage as the pieces the step loop takes (``diffusion/step_loop.py``), from its
runner's own parts. They are BAGEL's only denoising: the runner's whole call (``batching: request``) and
a step batcher's group run them to their end (``step_loop.run_whole``), so step caching, previews and a
parallel replica's forwards are layers there too. A request alone is exact against BAGEL's own code.

A request's state is its batch of one as the whole call makes it: its noise from its own generator, its
schedule, its rows (one per distinct context of its active branches) and its contexts' K/V bank. A step
runs the rows of every request of one image size in one velocity forward: their latent inputs side by
side, their banks' attention rows joined (each row attends to its own context, padded to the longest);
each request then combines its own branches with its own guidance and steps.

Step caching is the layer that answers a step with its guided output (``GuidedStepCacheLayer``): BAGEL's
whole call caches its guided velocity, not a forward's rows (the branches; guidance's renormalization is
not linear), so a request that skips a step leaves its rows out of the forward and takes the estimate of
its velocity. BAGEL has no LoRA adapters."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_plugin.diffusion.step_loop import (
    LoopLayer,
    decoded_by_group,
    denoiser_through,
    runs_in_loop,
    through_layers,
)
from vllm_omni_plugin.families.bagel.runner import AttentionRowsJoin, _Guidance, _RowPlan, flow_schedule
from vllm_omni_plugin.families.bagel.transformer import AttentionRows, ContextBank

if TYPE_CHECKING:
    from vllm_omni_plugin.families.bagel.request import BagelGenerationRequest
    from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner


@dataclass(eq=False)
class BagelState:
    latents: torch.Tensor
    """``x``: (1, tokens, channels), fp32."""
    timesteps: torch.Tensor
    dts: torch.Tensor
    plan: _RowPlan
    bank: ContextBank
    guidance: _Guidance
    times: torch.Tensor
    positions: torch.Tensor
    height: int
    width: int
    index: int = 0


class BagelSteps:
    """BAGEL's denoising, one step at a time, over every admitted request's rows."""

    def __init__(
        self,
        runner: BagelGenerationRunner,
        layers: Sequence[LoopLayer] = (),
        generators: Mapping[int, torch.Generator] | None = None,
    ) -> None:
        self.runner = runner
        self.layers: list[LoopLayer] = list(layers)
        self.generators = generators or {}
        """A whole call's generators by request object (the loop's requests draw from their seeds)."""
        self._own_denoiser = runner.denoiser()
        """The velocity forward as a module (what a parallel layer's stand-in replaces)."""
        self._joins: dict[Hashable, AttentionRowsJoin] = {}
        """One join per shape group: it keeps its joined rows while the group's requests stay."""

    def runs(self, request: BagelGenerationRequest) -> bool:
        return runs_in_loop(request, self.layers)

    def rows(self, request: BagelGenerationRequest) -> int:
        s = request.sampling
        return 1 + (s.cfg_text_scale > 1.0) + (s.cfg_text_scale > 1.0 and s.cfg_img_scale > 1.0)

    def encode(self, requests: list[BagelGenerationRequest]) -> list[None]:
        return [None] * len(requests)  # the thinker stage sent the contexts

    def prepare(self, request: BagelGenerationRequest, conditioning: None) -> BagelState:
        runner = self.runner
        cfg, model, device = runner.cfg, runner.transformer, runner.device
        tokens = (request.height // cfg.latent_downsample) * (request.width // cfg.latent_downsample)
        timesteps, dts = flow_schedule(request.sampling.num_inference_steps, request.sampling.timestep_shift)
        plan = _RowPlan([request], timesteps)
        generator = self.generators.get(id(request)) or torch.Generator("cpu").manual_seed(
            int(request.seed or 0)
        )
        noise = torch.randn(
            (tokens, cfg.latent_token_dim), generator=generator, device=generator.device, dtype=torch.float32
        )
        return BagelState(
            latents=noise[None].to(device), timesteps=timesteps, dts=dts.to(device), plan=plan,
            bank=ContextBank(plan.contexts, tokens + 2, model), guidance=_Guidance([request], device),
            times=model.time_embedding(timesteps),
            positions=model.latent_position_embedding(request.height, request.width),
            height=request.height, width=request.width,
        )  # fmt: skip

    def steps(self, state: BagelState) -> int:
        return len(state.timesteps)

    def shape(self, state: BagelState) -> Hashable:
        return state.height, state.width

    def denoise(self, states: list[BagelState]) -> None:
        """One velocity forward over the rows of the states no layer answers (step caching), then each
        state's guidance and step."""
        answered: dict[BagelState, torch.Tensor] = {}
        for s in states:
            for layer in self.layers:
                if (output := layer.answer(s)) is not None:
                    answered[s] = output
                    break
        computed = [s for s in states if s not in answered]
        guided = dict(zip(computed, self._guided(computed), strict=True)) if computed else {}
        for s in states:
            v = answered[s] if s in answered else guided[s]
            sample = s.latents
            for layer in self.layers:
                layer.stepped(s, sample, v)
            s.latents = sample - v * s.dts[s.index]
            s.index += 1

    def _guided(self, states: list[BagelState]) -> list[torch.Tensor]:
        """Each state's guided velocity, from one forward over every state's rows (their attention rows
        joined per shape group, kept while its states stay)."""
        model, device = self.runner.transformer, self.runner.device
        step_rows = [s.plan.at(s.index, s.bank, device) for s in states]
        inputs = [
            model.latent_input(s.latents, s.times[s.index], s.positions).index_select(0, rows.request_of_row)
            for s, rows in zip(states, step_rows, strict=True)
        ]
        attention = [s.bank.rows(rows.slots) for s, rows in zip(states, step_rows, strict=True)]
        counts = [len(rows.slots) for rows in step_rows]
        joined: AttentionRows = attention[0]
        if len(states) > 1:
            join = self._joins.setdefault(self.shape(states[0]), AttentionRowsJoin())
            joined = join.join(attention, counts)
        owners = [s for s, count in zip(states, counts, strict=True) for _ in range(count)]
        velocity = through_layers(self.layers, self._velocity)(
            owners, {"latents": torch.cat(inputs), "rows": joined}
        ).float()
        return [
            s.guidance.combine(
                own.index_select(0, rows.cond),
                own.index_select(0, rows.text),
                own.index_select(0, rows.img),
                rows.guided,
                rows.image_guided,
            )  # fmt: skip
            for s, rows, own in zip(states, step_rows, velocity.split(counts), strict=True)
        ]

    def _velocity(self, owners: list[Any], inputs: dict[str, Any]) -> torch.Tensor:
        denoiser = denoiser_through(self.layers, self._own_denoiser)
        return denoiser(latents=inputs["latents"], rows=inputs["rows"])

    def estimate(self, state: BagelState, sample: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """BAGEL's clean latents at a step: ``x - t * v``."""
        return sample - output * float(state.timesteps[state.index])

    def decode(self, states: list[BagelState]) -> list[Any]:
        def decode(size: Any, group: list[BagelState]) -> list[Any]:
            return self.runner._decode(torch.cat([s.latents for s in group]), *size)

        return decoded_by_group(states, self.shape, decode)
