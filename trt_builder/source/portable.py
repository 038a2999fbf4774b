"""Hugging Face files that the transformers of TensorRT-LLM 1.x's containers read as this host's
does. trt-builder runs transformers 5; TensorRT-LLM 1.2 pins transformers 4.57.1
(requirements.txt), and the NGC containers ship it. Files saved by transformers 5 (the embedded
default model's, dequantized from its GGUF; any model saved with it since) read wrong there:
- config.json: transformers 5 writes the RoPE base only inside `rope_parameters`; 4.57 reads
  `rope_theta` and `rope_scaling`, and without them runs SmolLM2 at base 10000, not 100000,
  and Qwen2.5-VL without its M-RoPE section (`rope_scaling.mrope_section`, a TypeError);
  it writes `dtype`, which 4.57 reads as `torch_dtype`;
- tokenizer_config.json: `"tokenizer_class": "TokenizersBackend"`, a class 4.57 does not have
  ("Tokenizer class TokenizersBackend does not exist"): the Triton tokenizer models and
  `LLM(...)` fail to load. `PreTrainedTokenizerFast` is the same class in 5 and exists in 4.

Both are rewritten with the keys each version reads, the values unchanged; tests/test_portable.py
reads the results with transformers 4.57.1 and 5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: What transformers 5 calls its fast tokenizer, and the name both versions know.
_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}
#: Loading arguments transformers 5 leaves in a saved tokenizer_config.json.
_LOADING_KEYS = ("is_local", "local_files_only")


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the keys transformers 4.57 reads beside 5's (its `text_config` too)."""
    out = dict(config)
    dtype = out.get("dtype") or out.get("torch_dtype")
    if dtype:
        out["dtype"] = out["torch_dtype"] = dtype
    params = out.get("rope_parameters")
    if isinstance(params, dict):
        if "rope_theta" in params:
            out.setdefault("rope_theta", params["rope_theta"])
        if params.get("rope_type", "default") != "default" and not out.get("rope_scaling"):
            out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        elif "mrope_section" in params and not out.get("rope_scaling"):
            # Qwen2.5-VL's M-RoPE: 4.57 reads the section from rope_scaling, as the hub's file has it
            out["rope_scaling"] = {"type": "mrope", "mrope_section": params["mrope_section"]}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = portable_config(out["text_config"])
    return out


def portable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json with a tokenizer class both versions have."""
    out = {k: v for k, v in config.items() if k not in _LOADING_KEYS}
    name = out.get("tokenizer_class")
    if name in _TOKENIZER_CLASSES:
        out["tokenizer_class"] = _TOKENIZER_CLASSES[name]
    return out


_REWRITE = {"config.json": portable_config, "tokenizer_config.json": portable_tokenizer_config}


def copy_portable(source: Path, target: Path) -> None:
    """Copy one Hugging Face file, config.json and tokenizer_config.json made portable."""
    rewrite = _REWRITE.get(source.name)
    if rewrite is None:
        shutil.copy2(source, target)
        return
    data = json.loads(source.read_text())
    target.write_text(json.dumps(rewrite(data), indent=2, sort_keys=True) + "\n")
