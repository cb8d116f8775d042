"""Backend ``ray``: every stage replica a Ray actor (``head.py``: the head's ``RayPlacement`` and
``RayStageClient``; ``actor.py``: ``StageReplicaActor``). Ray itself is imported only when used. Nothing
here imports the headless placement; both share ``placement.wire``."""
