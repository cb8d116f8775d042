"""Deploy configuration: schema, legacy translation, pipeline registry and the one resolution."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from vllm_omni_plugin.config import (
    PLATFORMS,
    ConfigError,
    Pipeline,
    PipelineStage,
    detect_pipeline,
    get_pipeline,
    load_deploy_file,
    packaged_deploy_configs,
    register_pipeline,
    resolve,
    resolve_deployment,
)
from vllm_omni_plugin.config import pipeline as pipeline_module
from vllm_omni_plugin.config.platform import PlatformInfo
from vllm_omni_plugin.config.resolve import reresolve
from vllm_omni_plugin.diffusion.runner import MAX_BATCH_SIZE, DiffusionRunner
from vllm_omni_plugin.schedulers import OMNI_AR_ASYNC_SCHEDULER, OMNI_AR_SCHEDULER

DATA = Path(__file__).parent / "data"
GPU, CPU = PLATFORMS["cuda"], PLATFORMS["cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory that identifies itself as GLM-Image (resolution reads only model_index.json)."""
    path = tmp_path_factory.mktemp("glm-image")
    (path / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    return str(path)


def write(tmp_path: Path, text: str, name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


# --- pipelines -----------------------------------------------------------------------------------


def test_glm_image_pipeline_topology() -> None:
    p = get_pipeline("glm_image")
    ar, dit = p.stage(0), p.stage(1)
    assert ar is not None and dit is not None
    assert (ar.name, ar.execution_type, ar.model_subdir, ar.tokenizer_subdir, ar.output_type) == (
        "ar",
        "llm_ar",
        "vision_language_encoder",
        "processor",
        "token_ids",
    )
    assert (dit.name, dit.execution_type, dit.input_sources, dit.final_output, dit.output_type) == (
        "dit",
        "diffusion",
        (0,),
        True,
        "image",
    )
    assert dit.input_processor is not None and dit.input_processor.endswith(
        "glm_image.processors.ar2diffusion"
    )


def test_pipeline_detection(tmp_path: Path, model_dir: str) -> None:
    assert detect_pipeline(model_dir) is get_pipeline("glm_image")
    (tmp_path / "config.json").write_text('{"architectures": ["GlmImageForConditionalGeneration"]}')
    assert detect_pipeline(str(tmp_path)) is get_pipeline("glm_image")
    assert detect_pipeline("zai-org/GLM-Image") is get_pipeline("glm_image")
    assert detect_pipeline(str(tmp_path / "nothing")) is None


def diffusers_dir(tmp_path: Path, class_name: str, name: str = "model") -> str:
    """A directory that names a diffusers pipeline class (resolution reads only model_index.json)."""
    path = tmp_path / name
    path.mkdir()
    (path / "model_index.json").write_text(f'{{"_class_name": "{class_name}"}}')
    return str(path)


def test_any_diffusers_directory_no_pipeline_claims_is_the_diffusion_pipeline(tmp_path: Path) -> None:
    for name in ("StableDiffusion3Pipeline", "FluxPipeline", "QwenImageEditPipeline", "DDPMPipeline"):
        assert detect_pipeline(diffusers_dir(tmp_path, name, name)) is get_pipeline("diffusion")
    assert detect_pipeline(diffusers_dir(tmp_path, "GlmImagePipeline", "glm")) is get_pipeline("glm_image")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    assert detect_pipeline(str(tmp_path / "text")) is None  # not a diffusers directory


@pytest.mark.parametrize("platform", [GPU, CPU], ids=["cuda", "cpu"])
def test_a_diffusers_model_resolves_to_one_diffusion_stage_without_a_config(tmp_path: Path, platform) -> None:
    model = diffusers_dir(tmp_path, "StableDiffusion3Pipeline")
    resolved = resolve_deployment(model, platform=platform)
    assert resolved.pipeline == "diffusion" and [s.name for s in resolved.stages] == ["diffusion"]
    stage = resolved.stage(0)
    assert (stage.execution_type, stage.process, stage.final_output, stage.input_sources) == (
        "diffusion",
        True,
        True,
        [],
    )
    assert stage.input_processor.endswith("families.diffusers.processors.request2diffusion")
    assert stage.diffusion_args == {
        "max_batch_size": MAX_BATCH_SIZE,  # unpinned: max_step_tokens bounds batches
        "model": model,
        "scheduling_policy": "fcfs",
        "worker_cls": platform.diffusion_worker_cls,
    }  # steps, guidance and size: the pipeline's own
    assert [(e.from_stage, e.to) for e in resolved.edges] == [(0, "router")]


def test_a_deploy_config_sets_every_knob_of_the_diffusion_stage(tmp_path: Path) -> None:
    model = diffusers_dir(tmp_path, "FluxPipeline")
    path = write(
        tmp_path,
        """
        pipeline: diffusion
        dtype: bfloat16
        stages:
          - stage_id: 0
            num_replicas: 2
            max_batch_size: 16
            batching: step
            batch_wait_ms: 2.5
            overlap_decode: false
            scheduling_policy: priority
            process: false
            num_inference_steps: 20
            guidance_scale: 3.5
            height: 512
            width: 768
            default_sampling_params: {seed: 7}
        """,
    )
    stage = resolve_deployment(model, deploy_config=str(path), platform=GPU).stage(0)
    assert (stage.num_replicas, stage.process) == (2, False)
    assert {k: v for k, v in stage.diffusion_args.items() if k not in ("model", "worker_cls")} == {
        "batch_wait_ms": 2.5,
        "batching": "step",
        "dtype": "bfloat16",
        "max_batch_size": 16,
        "overlap_decode": False,
        "scheduling_policy": "priority",
        "seed": 7,
    }
    assert stage.request_defaults == {
        "guidance_scale": 3.5,
        "height": 512,
        "num_inference_steps": 20,
        "width": 768,
    }


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ("batching: rows", "deploy.yaml:4: stages[0].batching: Invalid enum value 'rows'"),
        ("batch_wait_ms: -1", "deploy.yaml:4: stages[0].batch_wait_ms: expected float >= 0.0, got -1"),
        ("scheduling_policy: lifo", "deploy.yaml:4: stages[0].scheduling_policy: Invalid enum value 'lifo'"),
    ],
)
def test_a_bad_batching_setting_is_one_config_error(tmp_path: Path, stage: str, message: str) -> None:
    path = write(tmp_path, f"pipeline: diffusion\nstages:\n  - stage_id: 0\n    {stage}\n")
    with pytest.raises(ConfigError) as caught:
        resolve_deployment(diffusers_dir(tmp_path, "FluxPipeline"), deploy_config=str(path), platform=CPU)
    assert message in str(caught.value)


class WholeRequestRunner(DiffusionRunner):
    """An out-of-tree runner that batches whole requests only (its ``step_batching`` stays False);
    resolution reads the class, nothing runs it."""


def test_step_batching_of_a_runner_without_it_is_refused_by_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dit = PipelineStage(
        stage_id=0,
        name="gen",
        execution_type="diffusion",
        output_type="image",
        final_output=True,
        diffusion_runner=f"{__name__}.WholeRequestRunner",
    )
    # registered for this test only: the wire's union of request types is built from every registered runner
    monkeypatch.setattr(pipeline_module, "_PIPELINES", dict(pipeline_module._PIPELINES))
    register_pipeline(Pipeline(name="test_whole_request_runner", stages=(dit,)))
    path = write(
        tmp_path, "pipeline: test_whole_request_runner\nstages:\n  - stage_id: 0\n    batching: step\n"
    )
    with pytest.raises(ConfigError) as caught:
        resolve_deployment(str(tmp_path), deploy_config=str(path), platform=CPU)
    assert "deploy.yaml:4" in str(caught.value)
    assert "step batching is not available for test_whole_request_runner's diffusion runner" in str(
        caught.value
    )
    assert "(WholeRequestRunner); use batching: request" in str(caught.value)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (
            '{"_class_name": "DDPMPipeline"}',
            "DDPMPipeline cannot be served: its __call__ takes no prompt, height, width",
        ),
        ('{"_class_name": "NoSuchPipeline"}', "has no pipeline class 'NoSuchPipeline'"),
        ('{"_class_name": ["my_module", "MyPipeline"]}', "names no pipeline (_class_name)"),
        (None, "has no model_index.json: not a diffusers pipeline directory"),
    ],
)
def test_a_model_the_diffusion_pipeline_cannot_serve_is_one_config_error(
    tmp_path: Path, index: str | None, message: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if index is not None:
        (model / "model_index.json").write_text(index)
    path = write(tmp_path, "pipeline: diffusion\n")
    with pytest.raises(ConfigError, match="cannot serve") as caught:
        resolve_deployment(str(model), deploy_config=str(path), platform=GPU)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_register_out_of_tree_pipeline(tmp_path: Path) -> None:
    pipeline = Pipeline(
        name="test_two_stage",
        stages=(
            PipelineStage(stage_id=0, name="ar", execution_type="llm_ar"),
            PipelineStage(
                stage_id=1,
                name="gen",
                execution_type="diffusion",
                input_sources=(0,),
                output_type="image",
                final_output=True,
            ),
        ),
    )
    register_pipeline(pipeline)
    path = write(tmp_path, "pipeline: test_two_stage\nstages: [{stage_id: 1, num_inference_steps: 3}]\n")
    resolved = resolve_deployment(str(tmp_path), deploy_config=str(path), platform=CPU)
    assert resolved.pipeline == "test_two_stage"
    assert resolved.stage(1).request_defaults["num_inference_steps"] == 3
    with pytest.raises(ValueError, match="reads from unknown stage"):
        register_pipeline(
            Pipeline(
                name="broken",
                stages=(
                    PipelineStage(
                        stage_id=0,
                        name="x",
                        execution_type="diffusion",
                        input_sources=(5,),
                        final_output=True,
                    ),
                ),
            )
        )


# --- packaged configs ----------------------------------------------------------------------------


def test_packaged_configs_exist() -> None:
    names = {p.name for p in packaged_deploy_configs()}
    assert {"glm_image.yaml", "glm_image_nixl.yaml", "tiny_glm_image_cpu.yaml", "diffusion.yaml"} <= names


GLM_IMAGE_CONFIGS = [p for p in packaged_deploy_configs() if "glm_image" in p.name]
BAGEL_CONFIGS = [p for p in packaged_deploy_configs() if "bagel" in p.name]


DIFFUSION_CONFIGS = [p for p in packaged_deploy_configs() if p.name == "diffusion.yaml"]
QUANTIZED_DIFFUSERS_CONFIGS = {"flux_dev_24gb.yaml": "tiny_flux", "qwen_image_48gb.yaml": "tiny_qwen_image"}
"""The packaged files of one diffusers model each (sized for their GPUs by tests/test_gpu_memory_fit.py),
and the tiny model of the family they resolve with here."""


def test_every_packaged_config_is_tested() -> None:
    assert {p.name for p in packaged_deploy_configs()} == {
        p.name for p in (*GLM_IMAGE_CONFIGS, *BAGEL_CONFIGS, *DIFFUSION_CONFIGS)
    } | set(QUANTIZED_DIFFUSERS_CONFIGS)


@pytest.mark.parametrize("platform", [GPU, CPU], ids=["cuda", "cpu"])
@pytest.mark.parametrize("name", sorted(QUANTIZED_DIFFUSERS_CONFIGS))
def test_every_packaged_quantized_diffusers_config_resolves(
    name: str, platform: PlatformInfo, request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(QUANTIZED_DIFFUSERS_CONFIGS[name])
    path = next(p for p in packaged_deploy_configs() if p.name == name)
    args = resolve_deployment(str(model), deploy_config=str(path), platform=platform).stage(0).diffusion_args
    assert args["quantization"] == {"denoiser": "int8_weight_only", "text_encoders": "int8_weight_only"}
    assert args["worker_cls"] == platform.diffusion_worker_cls and args["dtype"] == "bfloat16"


@pytest.mark.parametrize("platform", [GPU, CPU], ids=["cuda", "cpu"])
@pytest.mark.parametrize("path", GLM_IMAGE_CONFIGS, ids=lambda p: p.name)
def test_every_packaged_glm_image_config_resolves(path: Path, platform, model_dir: str) -> None:
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=platform)
    ar = resolved.stage(0).engine_args
    assert ar["async_scheduling"] is platform.supports_async_scheduling
    assert ar["scheduler_cls"] == (OMNI_AR_ASYNC_SCHEDULER if ar["async_scheduling"] else OMNI_AR_SCHEDULER)
    assert ar["worker_cls"] == platform.ar_worker_cls
    assert ar["model"] == str(Path(model_dir) / "vision_language_encoder")
    assert ar["tokenizer"] == str(Path(model_dir) / "processor")
    assert resolved.stage(1).diffusion_args["model"] == model_dir
    assert resolved.stage(1).diffusion_args["worker_cls"] == platform.diffusion_worker_cls
    # every edge, including the final hop back to the router, has a connector
    assert [(e.from_stage, e.to) for e in resolved.edges] == [(0, 1), (1, "router")]
    assert all(e.connector in resolved.connectors for e in resolved.edges)


@pytest.mark.parametrize("platform", [GPU, CPU], ids=["cuda", "cpu"])
@pytest.mark.parametrize("path", BAGEL_CONFIGS, ids=lambda p: p.name)
def test_every_packaged_bagel_config_resolves(path: Path, platform, tiny_bagel: Path) -> None:
    """The thinker gets our architecture, BAGEL's positions and the connector of its edge to export
    contexts through; the DiT runs BAGEL's generation runner."""
    resolved = resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=platform)
    assert resolved.pipeline == "bagel"
    ar = resolved.stage(0).engine_args
    assert ar["hf_overrides"]["architectures"] == ["OmniBagelForConditionalGeneration"]
    assert "mrope_section" in ar["hf_overrides"]["rope_parameters"] and ar["disable_chunked_mm_input"]
    edge = resolved.edge(0, 1)
    kv_transfer = ar["kv_transfer_config"]
    assert kv_transfer["kv_connector"] == "ContextExportConnector"
    assert kv_transfer["kv_connector_module_path"] == "vllm_omni_plugin.ar_worker.context_export"
    assert kv_transfer["kv_role"] == "kv_producer"
    omni = kv_transfer["kv_connector_extra_config"]["omni"]
    exported = omni["context_connector"]
    assert (
        exported["name"] == edge.connector and exported["class"] == resolved.connectors[edge.connector].name
    )
    assert omni["next_position"] == "vllm_omni_plugin.models.bagel_thinker.context_next_position"
    dit = resolved.stage(1).diffusion_args
    assert dit["runner_cls"] == "vllm_omni_plugin.families.bagel.runner.BagelGenerationRunner"
    assert resolved.stage(0).continuation and resolved.stage(0).companion_timeout_s == 30.0


def test_nixl_config_puts_both_hops_on_nixl(model_dir: str) -> None:
    path = next(p for p in packaged_deploy_configs() if p.name == "glm_image_nixl.yaml")
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert {e.to: resolved.connectors[e.connector].name for e in resolved.edges} == {
        1: "NixlConnector",
        "router": "NixlConnector",
    }
    assert resolved.stage(1).output_connectors["to_stage_router"] == "nixl_dit_to_router"
    assert resolved.stage(0).replicas[0].env == {"CUDA_VISIBLE_DEVICES": "0"}  # vLLM's own runner (V2)
    assert resolved.edge(0, 1).max_inflight == 4 and resolved.edge(1, "router").max_inflight is None


def test_nixl_config_runs_the_dit_in_a_headless_worker(model_dir: str) -> None:
    path = next(p for p in packaged_deploy_configs() if p.name == "glm_image_nixl.yaml")
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert [s.headless for s in resolved.stages] == [False, True]
    assert (resolved.head.host, resolved.head.port) == ("0.0.0.0", 29600)
    assert resolved.head.heartbeat_timeout_s > resolved.head.heartbeat_interval_s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            """
            pipeline: glm_image
            stages: [{stage_id: 1, headless: true, process: false}]
            """,
            "stages[stage_id=1].process: a headless stage runs in processes of its own",
        ),
        (
            """
            pipeline: glm_image
            connectors: {local: {name: InProcessConnector}}
            stages:
              - {stage_id: 1, headless: true, input_connectors: {from_stage_0: local}}
            """,
            "InProcessConnector, which cannot reach a headless worker",
        ),
        (
            """
            pipeline: glm_image
            head: {heartbeat_interval_s: 5, heartbeat_timeout_s: 2}
            """,
            "head.heartbeat_timeout_s: heartbeat_timeout_s (2.0) must be longer than heartbeat_interval_s",
        ),
        (
            """
            pipeline: glm_image
            head: {port: 70000}
            """,
            "head.port",
        ),
    ],
)
def test_bad_headless_settings(tmp_path: Path, model_dir: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_deployment(model_dir, deploy_config=str(write(tmp_path, text)), platform=CPU)
    assert message in str(info.value)


def test_headless_stage_over_shared_memory_gets_a_note(tmp_path: Path, model_dir: str) -> None:
    path = write(tmp_path, "pipeline: glm_image\nstages: [{stage_id: 1, headless: true}]\n")
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=CPU)
    assert any("works only when the worker runs on the head's host" in n for n in resolved.notes)
    again = reresolve(resolved, load_deploy_file(path, model=model_dir, allow_legacy=False), CPU)
    assert again.stage(1).headless and again.head == resolved.head


def test_default_packaged_config_for_detected_pipeline(model_dir: str) -> None:
    resolved = resolve_deployment(model_dir, platform=GPU)
    assert resolved.stage(1).replicas[0].devices == "1"  # glm_image.yaml: DiT on device 1


# --- legacy stage_args ---------------------------------------------------------------------------


@pytest.mark.parametrize("platform", [GPU, CPU], ids=["cuda", "cpu"])
def test_legacy_nixl_document_resolves_like_its_stages_twin(platform, model_dir: str) -> None:
    legacy = resolve_deployment(
        model_dir, stage_configs_path=str(DATA / "legacy_glm_image_nixl.yaml"), platform=platform
    )
    twin = resolve_deployment(
        model_dir, deploy_config=str(DATA / "glm_image_nixl_stages.yaml"), platform=platform
    )
    assert legacy.summary() == twin.summary()
    ar = legacy.stage(0).engine_args
    # the matched pair: async on where the platform allows it, and the scheduler that goes with it
    assert ar["async_scheduling"] is platform.supports_async_scheduling
    assert ar["scheduler_cls"] == (OMNI_AR_ASYNC_SCHEDULER if platform is GPU else OMNI_AR_SCHEDULER)
    assert legacy.legacy_source is not None and twin.legacy_source is None
    pin_notes = [n for n in legacy.notes if "scheduler_cls pinned" in n]
    if platform is GPU:  # the pinned sync scheduler contradicts async: corrected, with the line of the pin
        (note,) = pin_notes
        assert note.startswith(f"{DATA / 'legacy_glm_image_nixl.yaml'}:33:")
        assert "OmniARAsyncScheduler" in note
    else:
        assert pin_notes == []
    ignored = "\n".join(legacy.notes)
    assert "runtime.enabled" in ignored and "is_comprehension" in ignored


def test_legacy_document_is_refused_by_deploy_config(model_dir: str) -> None:
    with pytest.raises(
        ConfigError, match=r"legacy_glm_image_nixl.yaml:\d+: stage_args: .*--stage-configs-path"
    ):
        resolve_deployment(model_dir, deploy_config=str(DATA / "legacy_glm_image_nixl.yaml"), platform=GPU)


def test_stages_document_through_stage_configs_path(model_dir: str) -> None:
    a = resolve_deployment(
        model_dir, stage_configs_path=str(DATA / "glm_image_nixl_stages.yaml"), platform=GPU
    )
    b = resolve_deployment(model_dir, deploy_config=str(DATA / "glm_image_nixl_stages.yaml"), platform=GPU)
    assert a.summary() == b.summary() and a.legacy_source is None


LEGACY_CASES = [
    (
        "stage_args:\n  - stage_id: 0\n    stage_type: diffusion\n",
        3,
        "stage_args[0].stage_type",
        "the stage type is fixed",
    ),
    (
        "stage_args:\n  - stage_id: 1\n    engine_input_source: [0, 2]\n",
        3,
        "stage_args[0].engine_input_source",
        "input sources",
    ),
    (
        "stage_args:\n  - stage_id: 0\n    engine_args:\n      model_subdir: transformer\n",
        4,
        "stage_args[0].engine_args.model_subdir",
        "fixed by pipeline",
    ),
    (
        "stage_args:\n  - stage_id: 1\n    custom_process_input_func: my.func\n",
        3,
        "stage_args[0].custom_process_input_func",
        "stage-input processor",
    ),
    (
        "stage_args:\n  - stage_id: 0\n    engine_args:\n      max_num_seqs: four\n",
        4,
        "stage_args[0].engine_args.max_num_seqs",
        'expected int, got "four"',
    ),
    (
        "stage_args:\n  - stage_id: 0\n    bogus: 1\n",
        3,
        "stage_args[0].bogus",
        "unknown stage_args field",
    ),
    (
        "stage_args:\n  - stage_id: 0\n    engine_args:\n      scheduler_cls: my.Sched\n",
        4,
        "engine_extras.scheduler_cls",
        "not an Omni AR scheduler",
    ),
    (
        "stage_args:\n  - stage_id: 7\n",
        2,
        "stage_args[0].stage_id",
        "has no stage 7",
    ),
]


@pytest.mark.parametrize(("text", "line", "field", "message"), LEGACY_CASES)
def test_legacy_errors_name_file_line_and_field(
    tmp_path: Path, model_dir: str, text: str, line: int, field: str, message: str
) -> None:
    path = write(tmp_path, text, "legacy.yaml")
    with pytest.raises(ConfigError) as info:
        resolve_deployment(model_dir, stage_configs_path=str(path), platform=GPU)
    text_out = str(info.value)
    assert text_out.startswith(f"{path}:{line}: "), text_out
    assert field in text_out and message in text_out


# --- stages-form errors ---------------------------------------------------------------------------

# fmt: off
STAGE_CASES = [
    ("stages:\n  - stage_id: 0\n  - stage_id: 1\n    max_num_seqs: four\n", 4, "stages[1].max_num_seqs",
     'expected int, got "four"'),
    ("stages:\n  - stage_id: 0\n    max_num_seq: 4\n", 3, "stages[0].max_num_seq", "did you mean 'max_num_seqs'"),
    ("stages:\n  - max_num_seqs: 4\n", 2, "stages[0]", "missing required field 'stage_id'"),
    ("stages:\n  - stage_id: 0\n    num_replicas: 0\n", 3, "stages[0].num_replicas", "expected int >= 1, got 0"),
    ("stages:\n  - stage_id: 0\n    gpu_memory_utilization: 1.5\n", 3, "stages[0].gpu_memory_utilization",
     "<= 1.0"),
    ("connectors:\n  a:\n    name: Mooncake\nstages:\n  - stage_id: 0\n    output_connectors: {to_stage_1: a}\n",
     3, "connectors.a.name", "known: InProcessConnector, MooncakeTransferEngineConnector, NixlConnector, SharedMemoryConnector"),
    ("connectors:\n  a:\n    nam: X\n", 3, "connectors.a.nam", "unknown field"),
    ("connectors:\n  a:\n    name: MooncakeTransferEngineConnector\n    extra:\n      protocol: udp\n"
     "stages:\n  - stage_id: 0\n    output_connectors: {to_stage_1: a}\n",
     5, "connectors.a.extra.protocol", "'udp'"),
    ("connectors:\n  a:\n    name: NixlConnector\n    extra:\n      backend: [UCX]\n", 5, "connectors.a.extra.backend",
     "unknown field (did you mean 'backends'?)"),
    ("connectors:\n  a:\n    name: SharedMemoryConnector\n    extra: {pool_bytes: big}\n", 4,
     "connectors.a.extra.pool_bytes", 'expected int, got "big"'),
    ("connectors:\n  a:\n    name: InProcessConnector\n    extra: {x: 1}\n", 4, "connectors.a.extra.x", "unknown field"),
    ("edges:\n  - {from: 0, to: 1, window_size: 8}\n", 2, "edges[0].window_size", "which has no effect here"),
    ("stages:\n  - stage_id: 1\n    default_sampling_params: {negative_prompt: blurry}\n", 3,
     "default_sampling_params", "negative_prompt, which would have no effect"),
    ("stages:\n  - stage_id: 0\n    env: {A: 1}\n", 3, "stages[0].env.A", "expected str, got 1"),
    ("stages:\n  - stage_id: 0\n    output_connectors:\n      to_stage_1: missing\n", 3,
     "output_connectors", "connector 'missing' is not defined"),
    ("stages:\n  - stage_id: 0\n    output_connectors:\n      to_stage_router: x\n", 3,
     "output_connectors", "only the final stage"),
    ("stages:\n  - stage_id: 9\n", 2, "stage_id", "has no stage 9"),
    ("stages:\n  - stage_id: 0\n    engine_extras:\n      max_num_seqz: 3\n", 4, "engine_extras.max_num_seqz",
     "not a vLLM EngineArgs field"),
    ("stages:\n  - stage_id: 0\n    engine_extras:\n      block_size: big\n", 4, "engine_extras.block_size",
     "expected"),
    ("stages:\n  - stage_id: 0\n    engine_extras:\n      max_num_seqs: 3\n", 4, "engine_extras.max_num_seqs",
     "is a stage field"),
    ("stages:\n  - stage_id: 0\n    devices: '0,1,2'\n    num_replicas: 2\n", 3, "devices",
     "cannot hold 2 replica(s)"),
    ("stages:\n  - stage_id: 0\n    default_sampling_params:\n      temprature: 0.5\n", 3,
     "default_sampling_params", "temprature: not a vLLM SamplingParams field"),
    ("stages:\n  - stage_id: 1\n    default_sampling_params:\n      foo: 1\n", 3, "default_sampling_params",
     "unknown diffusion sampling parameter"),
    ("stages:\n  - stage_id: 0\n  - stage_id: 0\n", 3, "stage_id", "listed twice"),
    ("stages:\n  - stage_id: 0\n    stage_id: 1\n", 3, "stages[0].stage_id", "duplicate key"),
    ("stages: [\n", 2, "", "not valid YAML"),
    ("- 1\n", 1, "", "expected a mapping at the top level"),
    ("stages:\n  - stage_id: 1\n    tensor_parallel_size: 2\n", 3, "tensor_parallel_size",
     "diffusion stages run with tensor_parallel_size 1"),
    ("stages:\n  - stage_id: 0\n    process: false\n", 3, "process", "own vLLM EngineCore process"),
    ("max_retries: -1\n", 1, "max_retries", ">= 0"),
    ("max_retries: twice\n", 1, "max_retries", 'expected int, got "twice"'),
]
# fmt: on


@pytest.mark.parametrize(("body", "line", "field", "message"), STAGE_CASES)
def test_errors_name_file_line_and_field(
    tmp_path: Path, model_dir: str, body: str, line: int, field: str, message: str
) -> None:
    top_level_list = body.startswith("-")
    path = write(tmp_path, body if top_level_list else "pipeline: glm_image\n" + body)
    line += 0 if top_level_list else 1  # lines in the table count from the body's first line
    with pytest.raises(ConfigError) as info:
        resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    text = str(info.value)
    assert text.startswith(f"{path}:{line}: "), text
    assert field in text and message in text, text


def test_max_retries_defaults_to_one_and_survives_reresolution(tmp_path: Path, model_dir: str) -> None:
    default = resolve_deployment(
        model_dir, deploy_config=str(write(tmp_path, "pipeline: glm_image\n")), platform=CPU
    )
    assert default.max_retries == 1 and "max_retries: 1" in default.to_yaml()
    path = write(tmp_path, "pipeline: glm_image\nmax_retries: 0\n")
    loaded = load_deploy_file(str(path), model=model_dir, allow_legacy=False)
    none = resolve(loaded, model=model_dir, platform=CPU)
    assert none.max_retries == 0
    assert reresolve(none, loaded, CPU).max_retries == 0


def test_top_level_errors_name_the_line(tmp_path: Path, model_dir: str) -> None:
    path = write(tmp_path, "pipeline: glm_image\nasync_chunk: true\n")
    with pytest.raises(ConfigError) as info:
        resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert str(info.value).startswith(f"{path}:2: async_chunk: async_chunk: true needs a streaming")


def test_unknown_pipeline_and_missing_file(tmp_path: Path, model_dir: str) -> None:
    path = write(tmp_path, "pipeline: nope\n")
    with pytest.raises(ConfigError, match=r"deploy.yaml:1: pipeline: unknown pipeline 'nope'"):
        resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    with pytest.raises(ConfigError, match="no such file"):
        resolve_deployment(model_dir, deploy_config=str(tmp_path / "missing.yaml"), platform=GPU)


def test_connector_ends_must_agree(tmp_path: Path, model_dir: str) -> None:
    path = write(
        tmp_path,
        """
        pipeline: glm_image
        connectors:
          a: {name: SharedMemoryConnector}
          b: {name: NixlConnector}
        stages:
          - stage_id: 0
            output_connectors: {to_stage_1: a}
          - stage_id: 1
            input_connectors: {from_stage_0: b}
        """,
    )
    with pytest.raises(ConfigError, match=r"deploy.yaml:9: .*both ends must agree"):
        resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)


def test_one_sided_connector_fills_the_other_end(tmp_path: Path, model_dir: str) -> None:
    path = write(
        tmp_path,
        """
        pipeline: glm_image
        connectors:
          n: {name: NixlConnector}
        stages:
          - stage_id: 1
            input_connectors: {from_stage_0: n}
        """,
    )
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert resolved.stage(0).output_connectors == {"to_stage_1": "n"}
    # the router hop had none: it gets shared memory
    assert resolved.connectors[resolved.edges[1].connector].name == "SharedMemoryConnector"


# --- layering and resolution ---------------------------------------------------------------------


def test_layers_in_order(tmp_path: Path, model_dir: str) -> None:
    write(
        tmp_path,
        """
        pipeline: glm_image
        dtype: float16
        stages:
          - stage_id: 0
            max_num_seqs: 1
            max_model_len: 100
            gpu_memory_utilization: 0.5
            enforce_eager: true
            kv_cache_memory_bytes: 1000
          - stage_id: 1
            num_inference_steps: 10
        """,
        "base.yaml",
    )
    path = write(
        tmp_path,
        """
        base_config: base.yaml
        stages:
          - stage_id: 0
            max_num_seqs: 2
            max_model_len: 200
            gpu_memory_utilization: 0.6
        platforms:
          cuda:
            stages:
              - stage_id: 0
                max_num_seqs: 3
                max_model_len: 300
          cpu:
            stages:
              - stage_id: 0
                max_num_seqs: 99
        """,
    )
    resolved = resolve_deployment(
        model_dir,
        deploy_config=str(path),
        platform=GPU,
        cli_engine_args={"max_num_seqs": 4, "block_size": 32},
        stage_overrides={"0": {"max_num_seqs": 5}, "1": {"num_inference_steps": 7}},
    )
    ar = resolved.stage(0).engine_args
    assert ar["max_num_seqs"] == 5  # --stage-overrides
    assert ar["block_size"] == 32  # command line (an EngineArgs field that is not a stage field)
    assert ar["max_model_len"] == 300  # platforms.cuda
    assert ar["gpu_memory_utilization"] == 0.6  # this file
    assert ar["kv_cache_memory_bytes"] == 1000 and ar["enforce_eager"] is True  # base_config
    assert ar["dtype"] == "float16"  # pipeline-wide field of the base
    assert resolved.stage(1).request_defaults["num_inference_steps"] == 7
    assert resolved.stage(1).diffusion_args["dtype"] == "float16"


def test_diffusion_defaults_are_merged_once_by_resolution(tmp_path: Path, model_dir: str) -> None:
    path = write(
        tmp_path,
        """
        pipeline: glm_image
        stages:
          - stage_id: 1
            num_inference_steps: 9
            default_sampling_params: {num_inference_steps: 3, guidance_scale: 2.5, seed: 5}
        """,
    )
    stage = resolve_deployment(model_dir, deploy_config=str(path), platform=CPU).stage(1)
    defaults, args = stage.request_defaults, stage.diffusion_args
    assert (defaults["num_inference_steps"], defaults["guidance_scale"]) == (9, 2.5)  # the field wins
    assert (defaults["height"], defaults["width"]) == (1024, 1024)  # the pipeline's defaults
    assert args["seed"] == 5 and "height" not in args  # the engine gets its seed, no request default
    assert "default_sampling_params" not in args  # nothing is left to merge at run time


def test_base_config_cycle_and_packaged_base(tmp_path: Path, model_dir: str) -> None:
    write(tmp_path, "pipeline: glm_image\nbase_config: b.yaml\n", "a.yaml")
    write(tmp_path, "pipeline: glm_image\nbase_config: a.yaml\n", "b.yaml")
    with pytest.raises(ConfigError, match=r"b.yaml:2: base_config: base_config cycle"):
        resolve_deployment(model_dir, deploy_config=str(tmp_path / "a.yaml"), platform=GPU)
    path = write(tmp_path, "base_config: glm_image.yaml\nstages: [{stage_id: 1, height: 512}]\n", "c.yaml")
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert resolved.stage(1).request_defaults["height"] == 512
    assert resolved.stage(1).request_defaults["num_inference_steps"] == 50  # from the packaged base


@pytest.mark.parametrize(
    ("flag", "platform", "expected_async"),
    [(None, GPU, True), (False, GPU, False), (True, GPU, True), (None, CPU, False), (True, CPU, False)],
)
def test_scheduler_follows_final_async_flag(tmp_path: Path, model_dir: str, flag, platform, expected_async):
    stage = "" if flag is None else f"\n    async_scheduling: {str(flag).lower()}"
    path = write(tmp_path, f"pipeline: glm_image\nstages:\n  - stage_id: 0{stage}\n")
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=platform)
    ar = resolved.stage(0).engine_args
    assert ar["async_scheduling"] is expected_async
    assert ar["scheduler_cls"] == (OMNI_AR_ASYNC_SCHEDULER if expected_async else OMNI_AR_SCHEDULER)
    forced = flag is True and platform is CPU
    assert any("does not support async scheduling" in n for n in resolved.notes) is forced


def test_pinned_scheduler_contradicting_cli_flag_is_corrected(tmp_path: Path, model_dir: str) -> None:
    path = write(
        tmp_path,
        f"""
        pipeline: glm_image
        stages:
          - stage_id: 0
            engine_extras:
              scheduler_cls: {OMNI_AR_ASYNC_SCHEDULER}
        """,
    )
    resolved = resolve_deployment(
        model_dir, deploy_config=str(path), platform=GPU, cli_engine_args={"async_scheduling": False}
    )
    assert resolved.stage(0).engine_args["scheduler_cls"] == OMNI_AR_SCHEDULER
    (note,) = [n for n in resolved.notes if "pinned" in n]
    assert note.startswith(f"{path}:5:")


def test_custom_scheduler_needs_opt_in(tmp_path: Path, model_dir: str) -> None:
    body = "pipeline: glm_image\nstages:\n  - stage_id: 0\n    engine_extras: {scheduler_cls: my.Sched}\n"
    with pytest.raises(ConfigError, match="allow_custom_scheduler"):
        resolve_deployment(model_dir, deploy_config=str(write(tmp_path, body)), platform=GPU)
    path = write(tmp_path, body + "    allow_custom_scheduler: true\n", "ok.yaml")
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert resolved.stage(0).engine_args["scheduler_cls"] == "my.Sched"


def test_stage_override_errors(model_dir: str) -> None:
    with pytest.raises(ConfigError, match=r"--stage-overrides: 0.max_num_seqs: expected int"):
        resolve_deployment(model_dir, platform=GPU, stage_overrides={"0": {"max_num_seqs": "x"}})
    with pytest.raises(ConfigError, match="has no stage 4"):
        resolve_deployment(model_dir, platform=GPU, stage_overrides={"4": {}})
    with pytest.raises(ConfigError, match="stage ids are integers"):
        resolve_deployment(model_dir, platform=GPU, stage_overrides={"ar": {}})


def test_replicas_split_devices(tmp_path: Path, model_dir: str) -> None:
    path = write(
        tmp_path,
        """
        pipeline: glm_image
        stages:
          - stage_id: 0
            devices: "0,1,2,3"
            num_replicas: 2
            tensor_parallel_size: 2
            env: {FOO: bar}
          - stage_id: 1
            devices: "4"
            num_replicas: 3
        """,
    )
    resolved = resolve_deployment(model_dir, deploy_config=str(path), platform=GPU)
    assert [r.devices for r in resolved.stage(0).replicas] == ["0,1", "2,3"]
    assert resolved.stage(0).replicas[1].env == {
        "FOO": "bar",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    assert [r.devices for r in resolved.stage(1).replicas] == ["4", "4", "4"]


@pytest.mark.parametrize("platform", [GPU, CPU], ids=["cuda", "cpu"])
@pytest.mark.parametrize(
    "path",
    [*packaged_deploy_configs(), DATA / "legacy_glm_image_nixl.yaml", DATA / "glm_image_nixl_stages.yaml"],
    ids=lambda p: p.name,
)
def test_resolution_is_idempotent(path: Path, platform, model_dir: str, tiny_bagel: Path) -> None:
    if path in BAGEL_CONFIGS:
        model_dir = str(tiny_bagel)
    loaded = load_deploy_file(path, model=model_dir, allow_legacy=True)
    first = resolve(loaded, model=model_dir, platform=platform)
    second = reresolve(first, loaded, platform)
    assert second.summary() == first.summary()
    assert second.deploy == first.deploy
    assert not [n for n in second.notes if "pinned" in n]


def test_resolved_yaml_round_trips(model_dir: str) -> None:
    resolved = resolve_deployment(model_dir, platform=GPU)
    assert yaml.safe_load(resolved.to_yaml()) == resolved.summary()


# --- BAGEL ---------------------------------------------------------------------------------------


def test_vllm_omni_bagel_document_loads_unchanged(tiny_bagel: Path) -> None:
    """vllm-omni's deploy/bagel.yaml (the one its stage proc/client refactor was tested with): keys that
    mean nothing for a diffusion stage are notes, not errors; its Mooncake connector, which no stage
    uses, is checked (a known class) and left out."""
    path = DATA / "bagel_vllm_omni_deploy.yaml"
    resolved = resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=GPU)
    notes = "\n".join(resolved.notes)
    for field in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        assert f"stage 1 {field}: does not apply to a diffusion stage; ignored" in notes
    assert "rdma_connector" not in resolved.connectors
    assert resolved.edge(0, 1).connector == "shared_memory_connector"
    assert resolved.stage(0).engine_args["max_num_seqs"] == 3
    assert resolved.stage(0).default_sampling_params["repetition_penalty"] == 1.05
    assert resolved.stage(1).diffusion_args["seed"] == 52


def test_vllm_omni_bagel_document_types_are_still_checked(tiny_bagel: Path, tmp_path: Path) -> None:
    text = (
        (DATA / "bagel_vllm_omni_deploy.yaml").read_text().replace("max_num_seqs: 1", 'max_num_seqs: "one"')
    )
    path = tmp_path / "bagel.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"bagel.yaml:22: stages\[1\].max_num_seqs: expected int"):
        resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=GPU)


def test_bagel_generation_settings_are_checked(tiny_bagel: Path, tmp_path: Path) -> None:
    path = tmp_path / "bagel.yaml"
    path.write_text("stages:\n  - stage_id: 1\n    default_sampling_params: {cfg_txt_scale: 2.0}\n")
    with pytest.raises(ConfigError, match="unknown diffusion sampling parameter.*cfg_txt_scale"):
        resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=GPU)


def test_bagel_context_export_needs_a_cross_process_connector(tiny_bagel: Path, tmp_path: Path) -> None:
    path = tmp_path / "bagel.yaml"
    path.write_text(
        "connectors: {mem: {name: InProcessConnector}}\n"
        "stages:\n  - stage_id: 0\n    output_connectors: {to_stage_1: mem}\n"
        "  - stage_id: 1\n    process: false\n"
    )
    with pytest.raises(ConfigError, match="context export runs in the vLLM worker process"):
        resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=GPU)


def test_a_stage_cache_block_resolves_with_its_defaults_and_platforms_merge_it_field_by_field(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        """
        pipeline: diffusion
        stages:
          - stage_id: 0
            cache: {policy: fixed, compute_every: 3}
        platforms:
          cpu:
            stages:
              - stage_id: 0
                cache: {warmup_steps: 4}
        """,
    )
    stage = resolve_deployment(diffusers_dir(tmp_path, "FluxPipeline"), deploy_config=str(path), platform=CPU)
    assert stage.stage(0).diffusion_args["cache"] == {
        "policy": "fixed",
        "compute_every": 3,
        "threshold": 0.1,
        "max_cached_steps": 3,
        "warmup_steps": 4,
        "final_steps": 1,
        "extrapolate": True,
    }


def test_a_stage_compile_block_reaches_the_diffusion_engine_as_written(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        pipeline: diffusion
        stages:
          - stage_id: 0
            compile: {blocks: true, warmup_sizes: [[512, 768]]}
        """,
    )
    stage = resolve_deployment(diffusers_dir(tmp_path, "FluxPipeline"), deploy_config=str(path), platform=CPU)
    assert stage.stage(0).diffusion_args["compile"] == {"blocks": True, "warmup_sizes": [(512, 768)]}
    path.write_text("pipeline: diffusion\nstages:\n  - stage_id: 0\n    compile: {blocks: false}\n")
    stage = resolve_deployment(str(tmp_path / "model"), deploy_config=str(path), platform=CPU)
    assert "compile" not in stage.stage(0).diffusion_args


@pytest.mark.parametrize(
    ("field", "block", "message"),
    [
        ("cache", "{policy: often}", "deploy.yaml:4: stages[0].cache.policy: Invalid enum value 'often'"),
        (
            "cache",
            "{compute_every: 0}",
            "deploy.yaml:4: stages[0].cache.compute_every: expected int >= 1, got 0",
        ),
        ("cache", "{every: 2}", "deploy.yaml:4: stages[0].cache.every: unknown field"),
        (
            "compile",
            "{blocks: true, shapes: bucketed}",
            "deploy.yaml:4: stages[0].compile.shapes: Invalid enum",
        ),
        (
            "compile",
            "{blocks: true, warmup_sizes: [[0, 64]]}",
            "compile.warmup_sizes[0][0]: expected int >= 1",
        ),
        ("compile", "{block: true}", "deploy.yaml:4: stages[0].compile.block: unknown field"),
    ],
)
def test_a_bad_acceleration_block_is_one_config_error(
    tmp_path: Path, field: str, block: str, message: str
) -> None:
    path = write(tmp_path, f"pipeline: diffusion\nstages:\n  - stage_id: 0\n    {field}: {block}\n")
    with pytest.raises(ConfigError) as caught:
        resolve_deployment(diffusers_dir(tmp_path, "FluxPipeline"), deploy_config=str(path), platform=CPU)
    assert message in str(caught.value)


@pytest.mark.parametrize("field", ["cfg_parallel_size", "sequence_parallel_size"])
def test_a_parallel_size_gives_each_diffusion_replica_that_many_devices(tmp_path: Path, field: str) -> None:
    path = write(
        tmp_path,
        f"""
        pipeline: diffusion
        stages:
          - {{stage_id: 0, {field}: 2, num_replicas: 2, devices: "0,1,2,3"}}
        """,
    )
    model = diffusers_dir(tmp_path, "StableDiffusion3Pipeline")
    stage = resolve_deployment(model, deploy_config=str(path), platform=GPU).stage(0)
    assert stage.diffusion_args[field] == 2
    assert [r.devices for r in stage.replicas] == ["0,1", "2,3"]
    path.write_text(f"pipeline: diffusion\nstages:\n  - {{stage_id: 0, {field}: 2, devices: '0,1,2'}}\n")
    with pytest.raises(ConfigError, match=rf"cannot hold 1 replica\(s\) of {field} 2"):
        resolve_deployment(model, deploy_config=str(path), platform=GPU)
    path.write_text(f"pipeline: diffusion\nbackend: ray\nstages:\n  - {{stage_id: 0, {field}: 2}}\n")
    resources = resolve_deployment(model, deploy_config=str(path), platform=GPU).stage(0).ray_resources
    assert resources is not None and resources.num_gpus == 2.0 and resources.placement_group


def test_a_parallel_size_on_a_runner_without_it_is_one_config_error(tmp_path: Path, tiny_bagel: Path) -> None:
    """BAGEL's DiT runs CFG-parallel (its guidance rows split), not sequence-parallel."""
    path = write(tmp_path, "pipeline: bagel\nstages:\n  - {stage_id: 1, sequence_parallel_size: 2}\n")
    with pytest.raises(ConfigError) as caught:
        resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=CPU)
    assert (
        "deploy.yaml:3: stages[stage_id=1].sequence_parallel_size: sequence parallelism is not available "
        "for bagel's diffusion runner (BagelGenerationRunner); remove sequence_parallel_size"
        in str(caught.value)
    )
    path.write_text("pipeline: bagel\nstages:\n  - {stage_id: 1, cfg_parallel_size: 3}\n")
    stage = resolve_deployment(str(tiny_bagel), deploy_config=str(path), platform=CPU).stage(1)
    assert stage.diffusion_args["cfg_parallel_size"] == 3


def test_cfg_and_sequence_parallelism_together_are_one_config_error(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pipeline: diffusion\nstages:\n  - {stage_id: 0, cfg_parallel_size: 2, sequence_parallel_size: 2}\n",
    )
    with pytest.raises(ConfigError) as caught:
        resolve_deployment(
            diffusers_dir(tmp_path, "StableDiffusion3Pipeline"), deploy_config=str(path), platform=GPU
        )
    assert (
        "deploy.yaml:3: stages[stage_id=0].sequence_parallel_size: cfg_parallel_size and sequence_parallel_size "
        "cannot be combined; choose one" in str(caught.value)
    )
