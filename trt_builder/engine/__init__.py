"""The engine: the pinned TensorRT-LLM releases, the trtllm-build command and its run, the memory plan, the engine manifest, the host (doctor) and the engine runtime (the engine stage)."""
