"""trt-builder: Hugging Face causal LM -> TensorRT-LLM checkpoint, engine and Triton repository."""

from __future__ import annotations

__version__ = "0.2.0"
