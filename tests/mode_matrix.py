"""The mode matrix: every mode `trt-builder build` offers, as the rows tests/test_modes.py builds
on the default model and scripts/checkpoint_digests.py converts (no trt_builder import, so the
script runs against any version of the package)."""

from __future__ import annotations

#: variant directory -> build's arguments. SmolLM2-135M has 9 attention heads and 3 KV heads,
#: so the tensor-parallel row is tp 3 (tp 2 divides neither and is refused, exit 2).
MATRIX: dict[str, tuple[str, ...]] = {
    "float16-tp1-pp1": ("--dtype", "float16"),
    "bfloat16-tp1-pp1": ("--dtype", "bfloat16"),
    "float32-tp1-pp1": ("--dtype", "float32"),
    "auto-tp1-pp1": ("--dtype", "auto"),
    "int8-wo-tp1-pp1": ("--dtype", "int8-wo"),
    "int8-wo-noclip-tp1-pp1": ("--dtype", "int8-wo", "--no-wo-clip"),
    "int8-sq-tp1-pp1": ("--dtype", "int8"),
    "int8-sq-static-tp1-pp1": ("--dtype", "int8", "--sq-granularity", "per-tensor"),
    "int8-sq-kv8-tp1-pp1": ("--dtype", "int8", "--kv-cache", "int8"),
    "float16-kv8-tp1-pp1": ("--dtype", "float16", "--kv-cache", "int8"),
    "int8-wo-kv8-tp1-pp1": ("--dtype", "int8-wo", "--kv-cache", "int8"),
    "int8-sq-tp3-pp1": ("--dtype", "int8", "--tp", "3"),
    "fp8-tp1-pp1": ("--dtype", "fp8"),
    "fp8-fp8kv-tp1-pp1": ("--dtype", "fp8", "--kv-cache", "fp8"),
    "fp8-nosearch-tp1-pp1": ("--dtype", "fp8", "--no-fp8-search"),
    "float16-fp8kv-tp1-pp1": ("--dtype", "float16", "--kv-cache", "fp8"),
    "int4-awq-tp1-pp1": ("--dtype", "int4-awq"),
    "int4-awq-fp8kv-tp1-pp1": ("--dtype", "int4-awq", "--kv-cache", "fp8"),
    # through the padded twin (hidden 768): W4A8's group 128 does not divide SmolLM2's 576
    "w4a8-awq-tp1-pp1": ("--dtype", "w4a8-awq"),
    "w4a8-awq-fp8kv-tp1-pp1": ("--dtype", "w4a8-awq", "--kv-cache", "fp8"),
    # NVFP4's engine needs Blackwell (SM 100+): the B200 target
    "nvfp4-tp1-pp1": ("--dtype", "nvfp4", "--target-gpu", "B200"),
    "nvfp4-fp8kv-tp1-pp1": ("--dtype", "nvfp4", "--kv-cache", "fp8", "--target-gpu", "B200"),
    # --target llmapi: the Hugging Face checkpoint and the llmapi repository (docs/llmapi.md)
    "float16-llmapi-tp1-pp1": ("--dtype", "float16", "--target", "llmapi"),
    "fp8-llmapi-tp1-pp1": ("--dtype", "fp8", "--target", "llmapi"),
    "fp8-fp8kv-llmapi-tp1-pp1": ("--dtype", "fp8", "--kv-cache", "fp8", "--target", "llmapi"),
    "int8-wo-llmapi-tp1-pp1": ("--dtype", "int8-wo", "--target", "llmapi"),
    "int4-awq-llmapi-tp1-pp1": ("--dtype", "int4-awq", "--target", "llmapi"),
    "w4a8-awq-llmapi-tp1-pp1": ("--dtype", "w4a8-awq", "--target", "llmapi"),
    # on the default H100 target: served weight-only through Marlin there (docs/llmapi.md)
    "nvfp4-llmapi-tp1-pp1": ("--dtype", "nvfp4", "--target", "llmapi"),
}
