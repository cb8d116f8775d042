"""Placements other than this host's: where a stage's replicas run when the deployment's ``backend``
says so (``ray``: Ray actors, ``ray.RayPlacement``). The stage factory picks one
(``factory.placement_for``); Ray is imported only then."""
