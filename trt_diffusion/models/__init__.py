"""Model folders: loading diffusers components (local or offline HF cache) and the tiny reference models."""
