"""The omni server's Prometheus metrics, in the registry vLLM's ``/metrics`` serves.

Per-stage queue depth, healthy replicas, restarts and denoising steps, and each connector's counters are
read from the runtime at scrape time (:class:`OmniCollector`); per-request latencies, images and failures are
recorded as requests finish (:class:`OmniMetrics`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm_omni_plugin.diffusion.params import DiffusionCounters
from vllm_omni_plugin.stage.async_omni import AsyncOmni
from vllm_omni_plugin.stage.orchestrator import OmniResult

ABORT_PLACES = ("queue", "batch", "engine")
DIFFUSION_TIMING = (
    (
        "omni_diffusion_steps",
        "steps",
        "Timed denoising steps of each diffusion stage: with whole-request batching each step of a batch "
        "after its first, with step batching each step boundary (one round of forwards over every group)",
    ),
    ("omni_diffusion_step_requests", "step_requests", "Requests in flight summed over the timed steps"),
    ("omni_diffusion_step_seconds", "step_seconds", "Seconds of the timed steps"),
    ("omni_diffusion_started_requests", "started", "Requests a diffusion stage took from its queue"),
    ("omni_diffusion_queue_wait_seconds", "queue_wait_seconds", "Seconds requests waited in the queue"),
    ("omni_diffusion_decodes", "decodes", "Pipeline calls (a batch, or a group) that decoded their images"),
    ("omni_diffusion_decode_seconds", "decode_seconds", "Seconds of VAE decode and post-processing"),
    ("omni_diffusion_encode_seconds", "encode_seconds", "Seconds of prompt encoding in those calls"),
    ("omni_diffusion_call_seconds", "call_seconds", "Seconds of those calls: encoding, steps and decode"),
    (
        "omni_diffusion_computed_blocks",
        "computed_blocks",
        "Denoiser block evaluations run, per request (a forward of B requests' rows counts B times)",
    ),
    (
        "omni_diffusion_cached_blocks",
        "cached_blocks",
        "Denoiser block evaluations step caching skipped, per request (cached over computed plus cached: "
        "the share saved)",
    ),
    (
        "omni_diffusion_preemptions",
        "preemptions",
        "Steps admitted requests were left out of for requests of better priority (batching: loop), per "
        "request",
    ),
    (
        "omni_diffusion_parked_states",
        "parked_states",
        "Preempted requests' denoising states moved to host memory for the memory budget's room "
        "(batching: loop on an accelerator)",
    ),
)
"""The diffusion stages' step, queue and decode counters: (Prometheus name, ``DiffusionCounters`` field,
help). Means are ratios: requests per step ``step_requests / steps``, step time ``step_seconds / steps``,
queue wait ``queue_wait_seconds / started_requests``, decode time ``decode_seconds / decodes``, a call's
prompt encoding ``encode_seconds / decodes`` and its whole time ``call_seconds / decodes``."""
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class OmniCollector:
    """Per-stage queue depth and health, and connector counters, read from the runtime at scrape time."""

    def __init__(self, omni: AsyncOmni) -> None:
        self.omni = omni

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        depth = GaugeMetricFamily(
            "omni_stage_queue_depth",
            "Requests in flight in each stage (all replicas)",
            labels=["stage", "name"],
        )
        healthy = GaugeMetricFamily(
            "omni_stage_healthy_replicas", "Replicas of each stage ready to serve", labels=["stage", "name"]
        )
        restarts = CounterMetricFamily(
            "omni_stage_replica_restarts",
            "Replica restarts after a stage process died",
            labels=["stage", "name"],
        )
        steps = CounterMetricFamily(
            "omni_diffusion_denoise_steps",
            "Denoising steps run by each diffusion stage, counted per request (a step of a batch of B "
            "requests counts B); rises while long images are still in progress",
            labels=["stage", "name"],
        )
        weights = GaugeMetricFamily(
            "omni_diffusion_weight_bytes",
            "Bytes of each diffusion stage's weights as its replicas hold them (quantized weights at their "
            "real size), summed over its ready replicas",
            labels=["stage", "name"],
        )
        timing = {
            field: CounterMetricFamily(name, text, labels=["stage", "name"])
            for name, field, text in DIFFUSION_TIMING
        }
        diffusion = {s.stage_id for s in self.omni.deployment.stages if s.execution_type == "diffusion"}
        deaths = CounterMetricFamily(
            "omni_stage_replica_deaths",
            "Stage replica processes (or engines) that died",
            labels=["stage", "name"],
        )
        retries = CounterMetricFamily(
            "omni_stage_retries",
            "Requests that ran a stage again because a replica died under them",
            labels=["stage", "name"],
        )
        exhausted = CounterMetricFamily(
            "omni_stage_retries_exhausted",
            "Requests failed (503) at a stage after more replica deaths than max_retries allows",
            labels=["stage", "name"],
        )
        quarantined = CounterMetricFamily(
            "omni_stage_quarantined_requests",
            "Requests failed (500) at a diffusion stage, not run again: its replica died while running "
            "them alone, after their batch had died under them before",
            labels=["stage", "name"],
        )
        aborted = CounterMetricFamily(
            "omni_stage_aborted_requests",
            "Aborted requests a stage dropped: queue (not started), batch (dropped from a running batch, no "
            "image made), engine (aborted in the AR engine)",
            labels=["stage", "name", "where"],
        )
        discarded = CounterMetricFamily(
            "omni_stage_discarded_outputs",
            "Stage outputs that arrived after their request was aborted, freed unread",
            labels=["stage", "name"],
        )
        orchestrator = self.omni.orchestrator
        for sid, pool in self.omni.pools.items():
            labels = [str(sid), pool.name]
            depth.add_metric(labels, pool.queue_depth)
            healthy.add_metric(labels, sum(1 for c in pool.clients if c.healthy))
            restarts.add_metric(labels, sum(c.restarts for c in pool.clients))
            if sid in diffusion:
                counted = DiffusionCounters.total(c.diffusion for c in pool.clients)
                steps.add_metric(labels, counted.denoise_steps)
                weights.add_metric(labels, sum(c.weight_bytes for c in pool.clients if c.healthy))
                for field, family in timing.items():
                    family.add_metric(labels, getattr(counted, field))
            deaths.add_metric(labels, sum(c.deaths for c in pool.clients))
            retries.add_metric(labels, orchestrator.retries[sid] if orchestrator else 0)
            exhausted.add_metric(labels, orchestrator.exhausted[sid] if orchestrator else 0)
            quarantined.add_metric(labels, orchestrator.quarantined[sid] if orchestrator else 0)
            for where in ABORT_PLACES:
                aborted.add_metric([*labels, where], sum(c.dropped[where] for c in pool.clients))
            discarded.add_metric(labels, sum(c.discarded_outputs for c in pool.clients))
        yield from (depth, healthy, restarts, steps, weights, deaths, retries, exhausted, quarantined)
        yield from (aborted, discarded)
        yield from timing.values()

        moved = CounterMetricFamily(
            "omni_connector_bytes",
            "Bytes put into / got from each connector, and put bytes a receiver confirmed reading",
            labels=["connector", "direction"],
        )
        ops = CounterMetricFamily(
            "omni_connector_operations", "Puts and gets on each connector", labels=["connector", "direction"]
        )
        errors = CounterMetricFamily("omni_connector_errors", "Failed puts and gets", labels=["connector"])
        timeouts = CounterMetricFamily(
            "omni_connector_timeouts", "Values released because their lease ran out", labels=["connector"]
        )
        outstanding = GaugeMetricFamily(
            "omni_connector_outstanding", "Values put and not yet released", labels=["connector"]
        )
        for name, connector in self.omni.connectors.items():
            try:
                h = connector.health()
            except Exception:  # a scrape must not fail because one connector is closing
                continue
            moved.add_metric([name, "put"], h.bytes_put)
            moved.add_metric([name, "get"], h.bytes_got)
            moved.add_metric([name, "acked"], h.bytes_acked)
            ops.add_metric([name, "put"], h.puts)
            ops.add_metric([name, "get"], h.gets)
            errors.add_metric([name], h.errors)
            timeouts.add_metric([name], h.timeouts)
            outstanding.add_metric([name], h.outstanding)
        yield from (moved, ops, errors, timeouts, outstanding)
        yield from self._context_exports()

    def _context_exports(self) -> Iterator[Any]:
        """What the AR stage's workers put into their context connector (KV handoff), as of the last stats
        interval: contexts, bytes put and acknowledged by their readers, values still held."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        exports = CounterMetricFamily(
            "omni_context_exports", "Contexts (K/V) the AR stage exported", labels=["stage", "replica"]
        )
        moved = CounterMetricFamily(
            "omni_context_export_bytes",
            "Bytes of exported contexts, put and acknowledged by the next stage",
            labels=["stage", "replica", "direction"],
        )
        held = GaugeMetricFamily(
            "omni_context_export_outstanding",
            "Exported contexts not yet released",
            labels=["stage", "replica"],
        )
        for sid, pool in self.omni.pools.items():
            for client in pool.clients:
                for h in client.last_connector_stats:
                    labels = [str(sid), str(client.replica_id)]
                    exports.add_metric(labels, h.get("puts", 0))
                    moved.add_metric([*labels, "put"], h.get("bytes_put", 0))
                    moved.add_metric([*labels, "acked"], h.get("bytes_acked", 0))
                    held.add_metric(labels, h.get("outstanding", 0))
        yield from (exports, moved, held)


class OmniMetrics:
    """Our metrics, in the registry vLLM's ``/metrics`` serves."""

    def __init__(self, omni: AsyncOmni, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self.registry = registry
        self.collector = OmniCollector(omni)
        self.stage_latency = Histogram(
            "omni_stage_latency_seconds",
            "Time each request spent in each stage (queueing in the stage included)",
            ["stage", "name"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.request_latency = Histogram(
            "omni_request_latency_seconds",
            "End-to-end time of each image through every stage",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.images = Counter(
            "omni_images_generated", "Images returned to clients", ["endpoint"], registry=None
        )
        self.failures = Counter(
            "omni_requests_failed",
            "Image requests that failed, by HTTP status",
            ["endpoint", "status"],
            registry=None,
        )
        self.disconnects = Counter(
            "omni_client_disconnects",
            "Requests whose client closed the connection before the answer; aborted in every stage",
            ["endpoint"],
            registry=None,
        )
        self._registered: list[Any] = []
        metrics = (self.collector, self.stage_latency, self.request_latency, self.images, self.failures)
        for metric in (*metrics, self.disconnects):
            registry.register(metric)
            self._registered.append(metric)

    def observe(self, endpoint: str, results: list[OmniResult], stage_names: dict[int, str]) -> None:
        for result in results:
            if result.ok:
                self.images.labels(endpoint).inc()
                if "total" in result.timings:
                    self.request_latency.labels(endpoint).observe(result.timings["total"])
            for sid, name in stage_names.items():
                value = result.timings.get(f"stage_{sid}")
                if value is not None:
                    self.stage_latency.labels(str(sid), name).observe(value)

    def close(self) -> None:
        for metric in self._registered:
            with contextlib.suppress(KeyError):
                self.registry.unregister(metric)
        self._registered.clear()
