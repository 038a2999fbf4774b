"""Conversion: HF weights to a TensorRT-LLM checkpoint, float and weight-only (floats), SmoothQuant, the INT8 KV cache's balancing and the INT8 recipe search (the convert stage)."""
