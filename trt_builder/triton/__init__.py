"""Triton Inference Server model repository (tensorrtllm_backend inflight-batcher layout)."""
