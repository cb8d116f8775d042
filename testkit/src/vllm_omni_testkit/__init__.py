"""Test support for vllm-omni-plugin, kept out of its wheel: ``harness`` (server processes, hold points,
Dynamo deployments on one host, network namespaces, leak checks, the soak and load drivers, the GPU check)
and ``reference`` (independent computations the served images are compared with)."""
