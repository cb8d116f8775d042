"""The local placement: every replica of a stage on this host (``placement.LocalPlacement``)."""
