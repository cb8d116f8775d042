"""vllm-omni-plugin: multi-stage omni serving on stock vLLM.

``register`` is the ``vllm.general_plugins`` entry point (name ``omni``). vLLM calls it in every process
it starts (API server, EngineCore, workers), so it must be cheap, idempotent and unable to take the
process down: it only records lazy registrations (dotted strings) and imports nothing heavy.
"""

from __future__ import annotations

__version__ = "0.1.0"

PLUGIN_NAME = "omni"
"""The entry-point name users put in ``VLLM_PLUGINS`` to enable the plugin."""


_registered = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_omni_plugin.log import get_logger

    logger = get_logger(__name__)
    try:
        from vllm_omni_plugin.registry import register_all

        register_all()
    except Exception:  # a plugin must never take a vLLM process down
        logger.exception("vllm-omni-plugin: registration failed; omni features are unavailable")
        return
    logger.debug("vllm-omni-plugin %s registered", __version__)
