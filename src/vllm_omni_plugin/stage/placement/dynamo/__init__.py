"""Stages served by Dynamo stage workers: the router's placement, whose replicas are the workers Dynamo's
discovery finds (``placement.py``), the stage worker (``worker.py``) and what they say (``protocol.py``)."""
