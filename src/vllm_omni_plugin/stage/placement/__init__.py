"""Where a stage's replicas run: the interface the runtime sees (``base.StagePlacement``), its
implementations each in a folder of its own (``local/``: this host; ``headless/``: a worker on another
host; ``ray/``: Ray actors) and what the remote ones share (``wire.py``). The stage factory picks one per
stage (``factory.placement_for``); Ray is imported only then."""
