"""What trtllm-build 0.20-1.2 loads from an FP8 checkpoint (`quant_algo: FP8`, and
`kv_cache_quant_algo: FP8`), per pinned release, read from upstream source (2026-12; not run:
no release installs here), and a check of a written checkpoint against it.

TL is NVIDIA/TensorRT-LLM. What was read, in the stored versions named below:
- `tensorrt_llm/quantization/quantize.py`, `fp8_quantize`: every ColumnLinear becomes an
  FP8Linear and every RowLinear an FP8RowLinear, unless `quantize_layers` matches its module
  name against an `exclude_modules` pattern (`fnmatch.fnmatchcase`; a given list replaces the
  default one, whose entries are `*lm_head`, `*vocab_embedding`, ...). `quantize_kv_cache`
  gives each attention `kv_cache_scaling_factor` ("for dequant") and
  `kv_cache_rcp_scaling_factor` ("for quant"), float32 (1,).
- `tensorrt_llm/quantization/layers.py`, FP8Linear and FP8RowLinear: `weight` fp8 of shape
  (out_features, in_features) of the rank (a column linear's out and a row linear's in divided
  by TP), `activation_scaling_factor` and `weights_scaling_factor` float32 (1,).
- `tensorrt_llm/models/modeling_utils.py`, `process_kv_scaling_factor`: a checkpoint without
  `kv_cache_rcp_scaling_factor` gets the reciprocal of `kv_cache_scaling_factor` at load
  ("legacy converters do not" write it), so writing only the latter is enough.
No stored copy sits at a release commit; each file was read in one stored version, dated by its
content to the 0.20-1.2 window at the earliest and 1.2 at the latest (the TensorRT engine path
was frozen there: `main` removed it after 1.2). Every release line therefore carries the same
rules, with evidence "probable", until a release-pinned copy says otherwise.

modes/fp8/convert.py writes what this table asks; `check_fp8` reads only the safetensors headers and
config.json, and the converter runs it on what it wrote (tests/test_fp8.py checks both ways).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...checkpoint.safetensors_io import read_header
from ...core.sources import Source

TL = "NVIDIA/TensorRT-LLM"
_LAYERS = Source(TL, "tensorrt_llm/quantization/layers.py", "2340c776")
_QUANTIZE = Source(TL, "tensorrt_llm/quantization/quantize.py", "06148676")
_LOADER = Source(TL, "tensorrt_llm/models/modeling_utils.py", "27712aa7")


@dataclass(frozen=True)
class Expected:
    """One tensor of a decoder layer that the FP8 engine declares: its name within the layer
    (`transformer.layers.{i}.` before it), safetensors dtype, and shape, as `weight` (the rank's
    (out, in) of the linear `linear`) or a fixed shape."""

    name: str
    dtype: str
    shape: str | tuple[int, ...]
    linear: str  # qkv, dense, fc, gate, proj
    kv_cache: bool  # only with kv_cache_quant_algo FP8
    required: bool  # False: the loader derives it when it is missing
    source: Source


def _linear(name: str, linear: str) -> tuple[Expected, ...]:
    return (
        Expected(f"{name}.weight", "F8_E4M3", "weight", linear, False, True, _LAYERS),
        Expected(f"{name}.weights_scaling_factor", "F32", (1,), linear, False, True, _LAYERS),
        Expected(f"{name}.activation_scaling_factor", "F32", (1,), linear, False, True, _LAYERS),
    )


#: A Llama-shaped decoder layer's FP8 tensors (GPT-2-shaped layers have no gate).
FP8_LAYER: tuple[Expected, ...] = (
    *_linear("attention.qkv", "qkv"),
    *_linear("attention.dense", "dense"),
    *_linear("mlp.fc", "fc"),
    *_linear("mlp.gate", "gate"),
    *_linear("mlp.proj", "proj"),
    Expected("attention.kv_cache_scaling_factor", "F32", (1,), "qkv", True, True, _QUANTIZE),
    Expected("attention.kv_cache_rcp_scaling_factor", "F32", (1,), "qkv", True, False, _LOADER),
)


@dataclass(frozen=True)
class CheckpointContract:
    """What one release line's trtllm-build loads from an FP8 checkpoint."""

    release: str
    evidence: str  # "read" | "probable" | "inferred", as in triton/conformance.py
    dated_by: str
    quant_algos: tuple[str, ...]  # config.json quantization.quant_algo values it builds as FP8
    kv_cache_quant_algos: tuple[str | None, ...]
    layer: tuple[Expected, ...]
    excluded_by: Source  # where exclude_modules is matched


_DATED = (
    "layers.py 2340c776, quantize.py 06148676 (and 89fd9b74, the same rules), modeling_utils.py "
    "27712aa7: no copy at a release commit; the engine path was frozen in 0.20-1.2"
)
CONTRACTS: dict[str, CheckpointContract] = {
    release: CheckpointContract(
        release, "probable", _DATED, ("FP8",), (None, "FP8"), FP8_LAYER, _QUANTIZE
    )
    for release in ("0.20", "0.21", "1.0", "1.1", "1.2")
}

#: The hidden_act values TensorRT-LLM's decoder builds a GatedMLP for (fc, gate and proj).
GATED = ("silu", "swiglu", "geglu")
_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def _shape(linear: str, config: dict[str, Any]) -> tuple[int, int]:
    """The rank's (out, in) of a decoder linear, from config.json."""
    hidden, tp = int(config["hidden_size"]), int(config["mapping"]["tp_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head = int(config.get("head_size") or hidden // heads)
    inter = int(config["intermediate_size"])
    kv_rank = max(kv // tp, 1)  # KV heads fewer than TP are duplicated, one per rank
    return {
        "qkv": ((heads // tp + 2 * kv_rank) * head, hidden),
        "dense": (hidden, heads * head // tp),
        "fc": (inter // tp, hidden),
        "gate": (inter // tp, hidden),
        "proj": (hidden, inter // tp),
    }[linear]


def check_fp8(checkpoint: Path, config: dict[str, Any], contract: CheckpointContract) -> list[str]:
    """Every way the FP8 checkpoint in `checkpoint` (config.json's content `config`, its
    rank{N}.safetensors) differs from what `contract`'s trtllm-build loads: a list of
    one-line problems, empty when it conforms."""
    quant = config.get("quantization") or {}
    problems = []
    if quant.get("quant_algo") not in contract.quant_algos:
        problems.append(f"quant_algo {quant.get('quant_algo')!r} is not FP8")
    kv_algo = quant.get("kv_cache_quant_algo")
    if kv_algo not in contract.kv_cache_quant_algos:
        problems.append(f"kv_cache_quant_algo {kv_algo!r} is not built with FP8")
    excluded = list(quant.get("exclude_modules") or [])
    model_dtype = _DTYPES[config["dtype"]]
    gated = config.get("hidden_act") in GATED  # a GatedMLP: the gate is a linear of its own
    for rank in range(int(config["mapping"]["world_size"])):
        header, _ = read_header(checkpoint / f"rank{rank}.safetensors")
        header.pop("__metadata__", None)
        layers = sorted(
            {int(n.split(".")[2]) for n in header if n.startswith("transformer.layers.")}
        )
        for i in layers:
            prefix = f"transformer.layers.{i}."
            for want in contract.layer:
                module = f"{prefix}{want.name.rsplit('.', 1)[0]}"
                if want.kv_cache and kv_algo != "FP8":
                    continue
                if not want.kv_cache and any(fnmatch.fnmatchcase(module, p) for p in excluded):
                    continue
                if want.linear == "gate" and not gated:
                    continue
                got = header.get(prefix + want.name)
                if got is None:
                    if want.required:
                        problems.append(f"rank {rank}: {prefix}{want.name} is missing")
                    continue
                shape = _shape(want.linear, config) if want.shape == "weight" else want.shape
                if got["dtype"] != want.dtype or tuple(got["shape"]) != tuple(shape):
                    problems.append(
                        f"rank {rank}: {prefix}{want.name} is {got['dtype']} {got['shape']}, "
                        f"trtllm-build {contract.release} declares {want.dtype} {list(shape)} "
                        f"({want.source})"
                    )
        for name in ("transformer.vocab_embedding.weight", "lm_head.weight"):
            got = header.get(name)
            if got is not None and got["dtype"] != model_dtype:
                problems.append(f"rank {rank}: {name} is {got['dtype']}, not the model dtype")
    return problems
