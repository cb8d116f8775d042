"""GLM-Image: an AR stage (``models/glm_image_ar.py``) writing prior tokens for diffusers' GLM-Image DiT."""
