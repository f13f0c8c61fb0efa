"""The pipeline's stages, one module each (distill/pipeline.py runs them in order)."""
