"""Headless stages: a stage's replicas on another host, run by a worker that registers with the head
(``head.py``: the head's placement, registry and client; ``worker.py``: the worker; ``protocol.py``: what
they say). Nothing here imports the Ray placement; both share ``placement.wire``."""
