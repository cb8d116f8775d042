"""Forwarding shim for stock vLLM's ``--omni`` hook.

Stock ``vllm`` imports ``vllm_omni.entrypoints.cli.main`` when ``--omni`` is on the command line. This
package holds only that forwarding module; everything lives in ``vllm_omni_plugin``.
"""

OMNI_PLUGIN_SHIM = True
