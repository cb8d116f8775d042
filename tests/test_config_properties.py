"""Property-based tests: whatever a user writes, configuration fails only with ConfigError, and
resolving a resolution changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_omni_plugin.config import PLATFORMS, ConfigError, packaged_deploy_configs, resolve
from vllm_omni_plugin.config.loader import load_document
from vllm_omni_plugin.config.resolve import reresolve
from vllm_omni_plugin.config.yaml_source import parse_yaml

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
SEEDS = [
    *(yaml.safe_load(p.read_text()) for p in packaged_deploy_configs()),
    yaml.safe_load((DATA / "legacy_glm_image_nixl.yaml").read_text()),
    yaml.safe_load((DATA / "glm_image_nixl_stages.yaml").read_text()),
]
MODEL = "/models/glm-image"
SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("CONFIG_PROPERTY_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["stage_id", "to_stage_1", "from_stage_0", "NixlConnector", "-1", "0,1", "auto"]),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, (*prefix, index))
    return out


def _mutate(doc: Any, path: tuple, op: str, value: Any, key: str) -> Any:
    if not path:
        return value if op == "replace" else doc
    parent, last = doc, path[-1]
    for part in path[:-1]:
        parent = parent[part]
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "insert" and isinstance(parent[last], dict):
        parent[last][key] = value
    elif op == "insert" and isinstance(parent[last], list):
        parent[last].append(value)
    return doc


def _resolve_text(text: str, platform_name: str) -> None:
    doc = parse_yaml(text, "mutated.yaml")
    loaded = load_document(doc, model=MODEL, allow_legacy=True)
    resolve(loaded, model=MODEL, platform=PLATFORMS[platform_name])


@SETTINGS
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    data=st.data(),
    op=st.sampled_from(["replace", "delete", "insert"]),
    value=values,
    key=st.one_of(st.text(max_size=10), st.sampled_from(["max_num_seqs", "engine_extras", "stages", "to"])),
    platform=st.sampled_from(["cuda", "cpu"]),
)
def test_mutated_configs_fail_only_with_config_error(seed, data, op, value, key, platform) -> None:
    import copy

    doc = copy.deepcopy(SEEDS[seed])
    path = data.draw(st.sampled_from(_paths(doc)))
    doc = _mutate(doc, path, op, value, key)
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    try:
        _resolve_text(text, platform)
    except ConfigError as exc:
        assert str(exc)  # always a message
        assert "mutated.yaml" in str(exc) or str(exc).startswith("--stage-overrides")


@SETTINGS
@given(text=st.text(max_size=200), platform=st.sampled_from(["cuda", "cpu"]))
def test_arbitrary_text_fails_only_with_config_error(text: str, platform: str) -> None:
    try:
        _resolve_text("pipeline: glm_image\n" + text, platform)
    except ConfigError:
        pass


stage0 = st.fixed_dictionaries(
    {"stage_id": st.just(0)},
    optional={
        "max_num_seqs": st.integers(1, 64),
        "max_model_len": st.integers(16, 4096),
        "async_scheduling": st.booleans(),
        "enforce_eager": st.booleans(),
        "devices": st.just("placeholder"),  # replaced by one device id per replica below
        "num_replicas": st.integers(1, 2),
        "gpu_memory_utilization": st.floats(0.1, 1.0),
        "engine_extras": st.fixed_dictionaries(
            {},
            optional={
                "block_size": st.sampled_from([16, 32]),
                "scheduler_cls": st.sampled_from(
                    [
                        "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler",
                        "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARAsyncScheduler",
                    ]
                ),
            },
        ),
        "default_sampling_params": st.fixed_dictionaries(
            {}, optional={"temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.05, 1.0)}
        ),
    },
)
stage1 = st.fixed_dictionaries(
    {"stage_id": st.just(1)},
    optional={
        "num_inference_steps": st.integers(1, 100),
        "guidance_scale": st.floats(0.0, 10.0),
        "height": st.sampled_from([64, 512, 1024]),
        "max_batch_size": st.integers(1, 8),
        "process": st.booleans(),
        "default_sampling_params": st.fixed_dictionaries({}, optional={"seed": st.integers(0, 100)}),
    },
)


@SETTINGS
@given(
    s0=stage0,
    s1=stage1,
    shm=st.booleans(),
    dtype=st.sampled_from([None, "bfloat16", "float32"]),
    platform=st.sampled_from(["cuda", "cpu"]),
)
def test_resolution_is_idempotent(s0, s1, shm, dtype, platform) -> None:
    doc: dict[str, Any] = {"pipeline": "glm_image", "stages": [s0, s1]}
    if dtype:
        doc["dtype"] = dtype
    if shm:
        doc["connectors"] = {"mem": {"name": "SharedMemoryConnector"}}
        s0["output_connectors"] = {"to_stage_1": "mem"}
    if "devices" in s0:
        s0["devices"] = ",".join(str(i) for i in range(s0.get("num_replicas", 1)))
    loaded = load_document(parse_yaml(yaml.safe_dump(doc), "random.yaml"), model=MODEL, allow_legacy=False)
    first = resolve(loaded, model=MODEL, platform=PLATFORMS[platform])
    second = reresolve(first, loaded, PLATFORMS[platform])
    assert second.summary() == first.summary()
    assert second.deploy == first.deploy
    third = reresolve(second, loaded, PLATFORMS[platform])
    assert third.summary() == first.summary()


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_idempotence_property_can_fail(platform: str) -> None:
    """The comparison above is not vacuous: a different layer changes the summary."""
    doc = {"pipeline": "glm_image", "stages": [{"stage_id": 0, "max_num_seqs": 3}]}
    loaded = load_document(parse_yaml(yaml.safe_dump(doc), "x.yaml"), model=MODEL, allow_legacy=False)
    a = resolve(loaded, model=MODEL, platform=PLATFORMS[platform])
    b = resolve(loaded, model=MODEL, platform=PLATFORMS[platform], cli_engine_args={"max_num_seqs": 4})
    assert a.summary() != b.summary()
