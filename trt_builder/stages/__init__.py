"""The pipeline's stages: fetch -> convert -> verify -> engine -> package."""
