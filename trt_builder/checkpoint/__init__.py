"""The TensorRT-LLM checkpoint format: streaming safetensors I/O, tensor- and pipeline-parallel ranks, and reading a checkpoint back."""
