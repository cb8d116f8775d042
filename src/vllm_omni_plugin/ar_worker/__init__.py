"""The AR stage's vLLM worker and what it adds to vLLM's model runner: the Omni CPU/GPU workers, one mixin
on vLLM's V1 GPU and CPU model runners, the V2 model state for planned positions, the context export KV
connector and the paged-KV reader. (A *runner* is what runs a stage's model forward: vLLM's model runner
here, ``DiffusionRunner`` in a DiT stage; this folder extends vLLM's, so it is named for the worker.)

Selected by configuration resolution through ``EngineArgs.worker_cls``; nothing here patches vLLM.
"""
