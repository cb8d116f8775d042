"""Omni workers and model runners: one mixin on vLLM's GPU and CPU model runners.

Selected by configuration resolution through ``EngineArgs.worker_cls``; nothing here patches vLLM.
"""
