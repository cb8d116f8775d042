"""Test support for vllm-omni-plugin, kept out of its wheel: ``holds`` (both sides of the hold points and
the fault hook that ``vllm_omni_plugin.test_hooks`` forwards to), ``harness`` (server processes, Dynamo
deployments on one host, network namespaces, leak checks, the soak and load drivers, the GPU check) and
``reference`` (independent computations the served images are compared with)."""
