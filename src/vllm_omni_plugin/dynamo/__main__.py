"""``python -m vllm_omni_plugin.dynamo``: see ``cli.py``."""

from vllm_omni_plugin.dynamo.cli import main

main()
