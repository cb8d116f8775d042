"""Any diffusers pipeline as a one-stage deployment: the generic runner, the Qwen-Image runners."""
