"""``vllm bench serve --omni``: vLLM's serving benchmark, for image servers (``serve.py``)."""
