"""The model families, one folder each: its pipeline declaration (``pipeline.py``), stage-input
processors (``processors.py``), DiT runner and request type (``runner.py``) and request settings
(``settings.py``). Generic code names them by dotted path only (``config.pipeline.FAMILY_PIPELINES``,
the declarations' strings, ``diffusion/diffusers_registry.py``); nothing outside this package imports it.
"""
