"""Native vLLM implementations of model architectures that stock vLLM lacks."""
