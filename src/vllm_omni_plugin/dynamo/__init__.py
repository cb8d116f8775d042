"""Serving under NVIDIA Dynamo: ``python -m vllm_omni_plugin.dynamo MODEL --deploy-config F.yaml``.

Dynamo's own HTTP frontend discovers a worker of ours and sends it OpenAI requests; the worker answers
them with this plugin's runtime. Roles (``cli.py``):

- pipeline (default): one process runs the whole deployment as ``vllm serve --omni`` does (its stages
  local, headless or on Ray) and registers the served model with Dynamo (``roles.py``);
- router (``--omni-router``): the same, but every stage's replicas are Dynamo stage workers found by
  discovery (``placement.py``: ``DynamoPlacement``, a ``StagePlacement``);
- stage (``--stage-id N``): serves one stage's replicas as a Dynamo endpoint for routers
  (``stage_worker.py``).

``request_fields.py`` maps Dynamo's request dicts onto our request types and our answers onto what the
frontend reads; ``stage_wire.py`` is what a router and its stage workers say to each other (the stage
messages and their codec). Neither imports anything of Dynamo. Nothing here imports Dynamo at import
time: only the roles do, once asked for (``runtime.py``), so the plugin runs without the ``dynamo`` extra.
Dynamo's own package is the top-level ``dynamo``; this package is ``vllm_omni_plugin.dynamo``, imported
absolutely everywhere, so it never stands in for Dynamo's.
"""
