"""Stage-input processors: build a stage's request from the user's request or its sources' outputs."""
