"""The memory plan: what an engine of this spec needs on the target GPU, per rank, and how many
sequences its KV cache then holds (docs/engine.md has the arithmetic and a worked example).

Per rank (the largest, when pipeline stages differ):
- weights: the decoder's linears split over tp (KV heads duplicated when fewer than tp), 2 bytes
  a parameter in float16/bfloat16 (4 in float32, 1 in INT8 or FP8 plus its scales), norms, and the
  embedding (first stage, whole on every tp rank) and lm_head (last stage, vocabulary split).
- KV cache per token: 2 (K and V) x layers of the stage x KV heads of the rank x head size x
  the cache's element size (1 for the INT8 and FP8 KV caches).
- activations: an estimate of what TensorRT reserves at build time for the largest batch of
  tokens (`max_num_tokens` tokens through one layer: hidden states, qkv, attention output, the
  MLP's intermediate, in the model dtype, doubled for the buffers alive at once) plus the logits
  of `max_batch_size` sequences in float32; and a fixed 1 GiB for the CUDA context, cuBLAS
  workspaces and the runtime's buffers.
- the KV cache gets what TensorRT-LLM gives it by default: 0.9 of the memory left
  (`kv_cache_free_gpu_mem_fraction`), in blocks of 32 tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..core.dtypes import BYTES, FLOATS
from ..core.errors import SpecError
from ..models.registry import family_for, family_of_checkpoint
from ..models.shape import AttentionShape
from ..modes import SmoothQuant, WeightStorage
from ..spec.build import BuildLimits as Limits  # the spec's own limits
from ..spec.gpus import GPUS, GpuSpec

GIB = 1024**3
#: TensorRT-LLM's default share of the free memory for the KV cache.
KV_FRACTION = 0.9
#: Tokens per KV-cache block (trtllm-build --tokens_per_block, 32 in every pinned release).
TOKENS_PER_BLOCK = 32
#: CUDA context, cuBLAS workspaces and runtime buffers.
OVERHEAD_BYTES = 1 * GIB
#: Largest max_batch_size the plan proposes (beyond it, scheduling rather than memory limits).
MAX_PROPOSED_BATCH = 256
#: TensorRT-LLM's default max_num_tokens (it warns beyond 16384: no gain, a risk of overflow).
DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, from its TensorRT-LLM config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head: int
    vocab: int
    gated: bool = True  # SwiGLU: fc, gate and proj

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        attention = AttentionShape.of(config)
        return cls(
            hidden=config["hidden_size"],
            intermediate=config.get("intermediate_size") or 4 * config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=attention.heads,
            kv_heads=attention.kv_heads,
            head=attention.head_size,
            vocab=config["vocab_size"],
            gated=family_of_checkpoint(config).gated_mlp,  # the registry says
        )


@dataclass(frozen=True)
class MemoryPlan:
    gpu: str
    gpu_bytes: int
    tp: int
    pp: int
    dtype: str
    weight_dtype: str  # the linears': float16 / int8 / fp8
    kv_dtype: str
    weight_bytes: int  # per rank, the largest
    kv_bytes_per_token: int  # per rank
    activation_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int  # what the KV cache gets on each rank (0 when nothing is left)
    limits: Limits
    kv_fraction: float = KV_FRACTION  # the deployment's kv_cache_free_gpu_mem_fraction
    linear: WeightStorage | None = None  # how the linears are stored (weight_dtype names it)

    @property
    def kv_tokens(self) -> int:
        return self.kv_budget_bytes // self.kv_bytes_per_token if self.kv_budget_bytes > 0 else 0

    def max_sequences(self, seq_len: int) -> int:
        """Sequences of `seq_len` tokens the KV cache holds at once (whole blocks each)."""
        per_sequence = math.ceil(seq_len / TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
        return self.kv_tokens // per_sequence

    @property
    def fits(self) -> bool:
        return self.max_sequences(self.limits.max_seq_len) >= 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("linear")
        data["gib"] = {
            k: round(v / GIB, 2)
            for k, v in data.items()
            if k.endswith("_bytes") and k != "kv_bytes_per_token"
        }
        data["kv_tokens"] = self.kv_tokens
        data["max_sequences_at_max_seq_len"] = self.max_sequences(self.limits.max_seq_len)
        data["proposed_max_batch_size"] = proposed_batch(self)
        return data


def _kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    return max(1, shape.kv_heads // tp)  # fewer KV heads than ranks: each rank holds a copy


#: The decoder linears a layer's weights are counted in (qkv, dense, fc, gate, proj).
LINEARS = 5


def weight_bytes(
    shape: ModelShape, tp: int, pp: int, dtype: str, linear: WeightStorage | None = None
) -> int:
    """Bytes of the largest rank's weights; `linear`: how the decoder linears are stored (the
    mode's, Mode.weights), when not in the model dtype."""
    act = BYTES[dtype]
    qkv_out = (shape.heads // tp + 2 * _kv_heads_per_rank(shape, tp)) * shape.head
    mlp_in = (3 if shape.gated else 2) * shape.intermediate // tp
    linear_params = shape.hidden * qkv_out + shape.heads // tp * shape.head * shape.hidden
    linear_params += shape.hidden * mlp_in
    rows = qkv_out + shape.hidden + mlp_in + shape.hidden  # output rows (per-channel scales)
    linears = linear_params * act if linear is None else linear.bytes(linear_params, rows, LINEARS)
    per_layer = linears + 2 * shape.hidden * act
    layers = shape.layers // pp
    embedding = shape.vocab * shape.hidden * act
    padded_vocab = math.ceil(shape.vocab / tp) * tp
    lm_head = padded_vocab // tp * shape.hidden * act + shape.hidden * act
    first = layers * per_layer + embedding + (lm_head if pp == 1 else 0)
    last = layers * per_layer + lm_head
    return max(first, last)


def kv_bytes_per_token(shape: ModelShape, tp: int, pp: int, kv_dtype: str) -> int:
    element = BYTES[kv_dtype]
    return 2 * (shape.layers // pp) * _kv_heads_per_rank(shape, tp) * shape.head * element


def activation_bytes(shape: ModelShape, tp: int, dtype: str, limits: Limits) -> int:
    act = BYTES[dtype]
    qkv_out = (shape.heads // tp + 2 * _kv_heads_per_rank(shape, tp)) * shape.head
    per_token = 4 * shape.hidden + qkv_out + shape.heads // tp * shape.head
    per_token += (2 if shape.gated else 1) * shape.intermediate // tp
    tokens, batch = limits.max_num_tokens, limits.max_batch_size
    assert tokens is not None and batch is not None  # plan() takes resolved limits only
    logits = batch * limits.max_beam_width * shape.vocab // tp * 4
    return 2 * tokens * per_token * act + logits


def plan(
    config: dict[str, Any],
    *,
    gpu: str,
    tp: int,
    pp: int,
    dtype: str,
    linear: WeightStorage | None,
    kv_dtype: str | None,
    limits: Limits,
    kv_fraction: float = KV_FRACTION,
) -> MemoryPlan:
    """The memory plan of a model (its TensorRT-LLM config) on `gpu`, for resolved limits;
    `linear` (the mode's quantized linears, Mode.weights) and `kv_dtype` (int8, fp8): None for
    the model dtype."""
    if not limits.resolved:
        raise ValueError("internal: plan() needs resolved limits (memplan.resolve_limits)")
    shape = ModelShape.from_config(config)
    spec: GpuSpec = GPUS[gpu]
    kv_dtype = kv_dtype or dtype
    weights = weight_bytes(shape, tp, pp, dtype, linear)
    activations = activation_bytes(shape, tp, dtype, limits)
    total = int(spec.memory_gib * GIB)
    free = total - weights - activations - OVERHEAD_BYTES
    return MemoryPlan(
        gpu=gpu,
        gpu_bytes=total,
        tp=tp,
        pp=pp,
        dtype=dtype,
        weight_dtype=dtype if linear is None else linear.name,
        kv_dtype=kv_dtype,
        weight_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(shape, tp, pp, kv_dtype),
        activation_bytes=activations,
        overhead_bytes=OVERHEAD_BYTES,
        kv_budget_bytes=max(0, int(free * kv_fraction)),
        limits=limits,
        kv_fraction=kv_fraction,
        linear=linear,
    )


def proposed_batch(memory: MemoryPlan) -> int:
    """max_batch_size from the plan: the sequences of max_seq_len the KV cache holds, as a power
    of two, at most MAX_PROPOSED_BATCH."""
    n = min(memory.max_sequences(memory.limits.max_seq_len), MAX_PROPOSED_BATCH)
    return 1 << (n.bit_length() - 1) if n >= 1 else 1


def _replan(config: dict[str, Any], memory: MemoryPlan, **changes: Any) -> MemoryPlan:
    """`memory`'s plan again with some of its inputs changed."""
    inputs = {
        "gpu": memory.gpu, "tp": memory.tp, "pp": memory.pp, "dtype": memory.dtype,
        "linear": memory.linear, "kv_dtype": memory.kv_dtype,
        "limits": memory.limits, "kv_fraction": memory.kv_fraction,
    }  # fmt: skip
    return plan(config, **{**inputs, **changes})


def alternatives(config: dict[str, Any], memory: MemoryPlan, *, gpu_count: int = 8) -> list[str]:
    """What would fit when `memory` does not: more tensor-parallel ranks, INT8, shorter
    sequences, a larger GPU (the first of each that fits)."""
    heads = ModelShape.from_config(config).heads
    found = []
    for tp in (2, 4, 8):
        if tp > memory.tp and tp * memory.pp <= gpu_count and heads % tp == 0:
            trial = _replan(config, memory, tp=tp)
            if trial.fits:
                found.append(f"--tp {tp} ({trial.weight_bytes / GIB:.1f} GiB of weights per rank)")
                break
    if memory.linear is None:  # the default INT8 mode's weights
        int8 = SmoothQuant()
        trial = _replan(config, memory, linear=int8.weights)
        if trial.fits:
            choice = next(iter(int8.CHOICES))
            found.append(
                f"--dtype {choice} ({trial.weight_bytes / GIB:.1f} GiB of weights per rank)"
            )
    lim = memory.limits
    if lim.max_seq_len > 1024:
        shorter = replace(lim, max_seq_len=1024, max_input_len=min(lim.max_input_len, 1024))
        if _replan(config, memory, limits=shorter).fits:
            found.append("--max-seq-len 1024")
    for gpu in GPUS.values():
        if (
            gpu.memory_gib > GPUS[memory.gpu].memory_gib
            and _replan(config, memory, gpu=gpu.name).fits
        ):
            found.append(f"--target-gpu {gpu.name}")
            break
    return found


def resolve_limits(spec: Any, hf_config: dict[str, Any]) -> tuple[Any, MemoryPlan]:
    """The spec with the limits it left to the plan filled in, and the plan of those limits.

    max_batch_size: the sequences of max_seq_len that the KV cache holds at once (a power of
    two, at most MAX_PROPOSED_BATCH). With Triton's default scheduler (guaranteed_no_evict) a
    request is admitted only when its whole max_seq_len fits, so a larger batch would never run.
    max_num_tokens: TensorRT-LLM's default 8192, or less when max_batch_size x max_seq_len is
    less. A larger batch needs more logits memory: it is halved until its plan holds it."""
    lim = spec.limits

    def limits_for(batch: int) -> Limits:
        tokens = lim.max_num_tokens or min(DEFAULT_MAX_NUM_TOKENS, batch * lim.max_seq_len)
        return replace(lim, max_batch_size=batch, max_num_tokens=tokens)

    memory = plan_for(replace(spec, limits=limits_for(lim.max_batch_size or 1)), hf_config)
    if lim.max_batch_size is None:
        config = _trtllm_config(hf_config)
        batch = proposed_batch(memory)
        while True:
            memory = _replan(config, memory, limits=limits_for(batch))
            if batch == 1 or memory.max_sequences(lim.max_seq_len) >= batch:
                break
            batch //= 2
    return replace(spec, limits=memory.limits), memory


def _trtllm_config(hf_config: dict[str, Any]) -> dict[str, Any]:

    return family_for(hf_config).config(hf_config)


def plan_for(spec: Any, hf_config: dict[str, Any]) -> MemoryPlan:
    """The plan of a build spec for a model's HF config; refuses (SpecError) a spec that
    cannot hold one sequence of max_seq_len, naming what would."""

    config = _trtllm_config(hf_config)
    mode = spec.mode
    dtype = mode.dtype if mode.dtype in FLOATS else "float16"  # auto: float16 at most
    lim = spec.limits
    memory = plan(
        config,
        gpu=spec.target_gpu,
        tp=spec.tp,
        pp=spec.pp,
        dtype=dtype,
        linear=mode.weights,
        kv_dtype={"int8": "int8", "fp8": "fp8"}.get(mode.kv_cache),
        limits=lim,
        kv_fraction=spec.triton.kv_cache_free_gpu_mem_fraction,
    )
    if not memory.fits:
        need = (memory.weight_bytes + memory.activation_bytes + memory.overhead_bytes) / GIB
        fixes = alternatives(config, memory) or ["a larger GPU"]
        raise SpecError(
            f"{spec.variant} does not fit {spec.target_gpu} ({GPUS[spec.target_gpu].memory_gib:g} "
            f"GiB): {need:.1f} GiB per rank before the KV cache, which then cannot hold one "
            f"sequence of {lim.max_seq_len} tokens; use {' or '.join(fixes)}"
        )
    return memory
