"""The deployment the multi-process and multi-host tests run over the network connectors: NIXL from the
AR stage to the DiT, Mooncake's transfer engine (TCP) from the DiT back to the API server, so that every
test meets what both of them hold; NIXL on both edges where Mooncake is not installed."""

from __future__ import annotations

from vllm_omni_plugin.connectors.mooncake import mooncake_missing

CONNECTOR_EXTRA = {
    "NixlConnector": "{transfer_timeout_s: 30}",
    "MooncakeTransferEngineConnector": "{protocol: tcp, transfer_timeout_s: 30}",
}
"""Each network connector's settings."""


def network_connectors() -> str:
    """The deploy file's ``connectors:`` block (``ar_to_dit``, ``dit_to_router``) of that deployment."""
    back = "NixlConnector" if mooncake_missing() else "MooncakeTransferEngineConnector"
    return (
        "connectors:\n"
        f"  ar_to_dit: {{name: NixlConnector, extra: {CONNECTOR_EXTRA['NixlConnector']}}}\n"
        f"  dit_to_router: {{name: {back}, extra: {CONNECTOR_EXTRA[back]}}}\n"
    )
