"""Called by stock vLLM's ``maybe_run_omni()``; forwards to the plugin's CLI."""


def main() -> None:
    from vllm_omni_plugin.entrypoints.cli import main as plugin_main

    plugin_main()
