"""Every vLLM internal we import resolves on the installed vLLM."""

import pytest

from vllm_omni_plugin import compat


@pytest.mark.parametrize("name", sorted(compat.LOCATIONS))
def test_every_compat_name_resolves(name: str) -> None:
    value = compat.resolve(name)
    assert value is not None
    assert getattr(compat, name) is value


def test_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(compat.CompatImportError, match="not a name of"):
        compat.resolve("no_such_thing")


def test_missing_location_names_every_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compat.LOCATIONS, "Gone", ("vllm.no_such_module:Gone", "vllm.engine.arg_utils:Gone"))
    with pytest.raises(compat.CompatImportError) as info:
        compat.resolve("Gone")
    message = str(info.value)
    assert "vllm.no_such_module:Gone" in message
    assert "no attribute 'Gone'" in message
