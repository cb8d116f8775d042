"""Connectors move large stage outputs between stages; messages carry only their handles."""

from __future__ import annotations

CONNECTOR_CLASSES: dict[str, str] = {
    "SharedMemoryConnector": "vllm_omni_plugin.connectors.shared_memory:SharedMemoryConnector",
    "NixlConnector": "vllm_omni_plugin.connectors.nixl:NixlConnector",
    "MooncakeTransferEngineConnector": "vllm_omni_plugin.connectors.mooncake:MooncakeTransferEngineConnector",
    "InProcessConnector": "vllm_omni_plugin.connectors.base:InProcessConnector",
}
"""Connector class names a deploy config may use -> where the class lives (imported lazily)."""

DEFAULT_CONNECTOR_CLASS = "SharedMemoryConnector"


def register_connector(name: str, target: str) -> None:
    """Make an out-of-tree connector class usable from deploy configs (``module:Class``)."""
    CONNECTOR_CLASSES[name] = target
