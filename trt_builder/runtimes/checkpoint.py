"""A torch runtime that executes a TensorRT-LLM checkpoint with TensorRT-LLM's semantics.

It reads config.json and the rank{N}.safetensors files as the engine builder would (TensorRT-LLM
names, fc/gate order, fused QKV, W8A16 per-channel INT8 rounding, rotary_base / rotary_scaling,
TP/PP ranks merged back) and computes in float32 while rounding every activation the engine
stores to the checkpoint dtype, so float16 overflow and rounding show up here as on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..checkpoint import int4, nvfp4, w4a8
from ..checkpoint.fp8 import E4M3, to_e4m3
from ..checkpoint.reader import read_checkpoint
from ..core.dtypes import torch_dtype
from ..core.errors import InputError
from ..models.shape import AttentionShape
from ..modes import mode_of
from ..modes.weight_only.checkpoint import WEIGHT_ONLY_LINEARS
from ..targets.llmapi.checkpoint.unified import PYTORCH_BACKEND, WEIGHT_SCALE
from .fp8 import fp8_kernel_runs, fp8_matmul, simulation_dtype
from .int8 import int8_matmul, quantize_static, quantize_tokens


def rope_inv_freq(dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotary inverse frequencies, with linear or llama3 scaling applied."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = (scaling or {}).get("type") or (scaling or {}).get("rope_type")
    if kind == "linear":
        inv = inv / float(scaling["factor"])  # type: ignore[index]
    elif kind == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(medium, smoothed, inv)
    elif kind not in (None, "default"):
        raise InputError(f"rotary_scaling type {kind!r} is not supported by the checkpoint runtime")
    return inv.float()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # TensorRT-LLM's gelu is the tanh form


_ACTIVATIONS: dict[str, Any] = {
    "silu": F.silu,
    "swiglu": F.silu,
    "gelu": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
}

#: Decoding runs its float GEMMs on blocks of exactly this many rows (the last one zero-padded), so
#: that a sequence's logits never depend on how many others share its step: BLAS picks kernels by
#: shape (on the CPU, measured: MKL gives one row, two or three rows, and four or more rows
#: different roundings; cuBLAS's choice depends on M too), and int8 rounding amplifies a
#: last-bit difference into another token.
DECODE_ROWS = 8


def weight_only_int8(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the W8A16 engine multiplies by: per-output-channel INT8, scale = amax/128 in `dtype`."""
    w = weight.float()
    scale = (
        (w.abs().amax(dim=1, keepdim=True) / 128.0)
        .to(dtype)
        .float()
        .clamp(min=torch.finfo(dtype).tiny)
    )
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


def _in_blocks(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """fn over x [rows, ...] in blocks of exactly DECODE_ROWS rows (the last zero-padded): a
    reduction's kernel, like a GEMM's, is chosen by shape (on CUDA, measured: a norm over one
    row and over eight rounds differently)."""
    rows = x.shape[0]
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, -rows % DECODE_ROWS))
    return torch.cat([fn(block) for block in padded.split(DECODE_ROWS)])[:rows]


def _fixed_rows_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ weight.T [k, n], on blocks of exactly DECODE_ROWS rows of x."""
    flat = _in_blocks(lambda block: block @ weight.T, x.reshape(-1, x.shape[-1]))
    return flat.reshape(*x.shape[:-1], weight.shape[0])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class KVCache:
    """Per-layer keys and values, [batch, kv_heads, tokens, head_size], in the checkpoint dtype
    grid; `pad` is each sequence's count of left padding."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    pad: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


class CheckpointRuntime:
    """Executes a TensorRT-LLM checkpoint of any registered family; TP/PP ranks are merged first.

    What a layer does is read from the checkpoint, as the engine builder reads it: LayerNorm
    where the norms have biases (GPT-2) else RMSNorm; a gated MLP where `mlp.gate` exists
    (SwiGLU) else fc -> activation -> proj; q/k RMSNorm where `q_layernorm` exists (Qwen3);
    learned positions or rope from `position_embedding_type`; biases wherever they are stored.
    """

    def __init__(
        self, config: dict[str, Any], weights: dict[str, torch.Tensor], device: str = "cpu"
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = torch_dtype(config["dtype"])
        self.mode = mode_of(config.get("quantization") or {}, str(config["dtype"]))
        self.smoothquant = self.mode.activations == "int8"  # the SmoothQuant plugin's GEMM
        self.per_token = self.mode.dynamic_activations
        # INT8 weights and float activations (W8A16): the builder rounds the float weights
        self.weight_only = self.mode.weights is not None and self.mode.activations is None
        # INT4 weights in groups (W4A16 AWQ): unpacked and dequantized as the GEMM does
        self.int4 = int4.holds_int4(self.mode)
        # W4A8 AWQ: those INT4 groups through an FP8 stage, times FP8 inputs (checkpoint/w4a8.py),
        # the input quantized as the engine does, or as the PyTorch backend does for the llmapi
        # target's checkpoint (read_unified marks it)
        self.w4a8 = self.int4 and self.mode.activations is not None
        self.engine_inputs = not config.get(PYTORCH_BACKEND, False)
        # NVFP4: e2m1 weights and inputs in blocks of 16, the inputs quantized at run time
        self.fp4 = nvfp4.holds_nvfp4(self.mode)
        self.kv_int8, self.kv_fp8 = self.mode.kv_int8, self.mode.kv_fp8
        self.w = {k: v.to(device) for k, v in weights.items()}
        attention = AttentionShape.of(config)
        self.heads, self.kv_heads, self.head = (
            attention.heads,
            attention.kv_heads,
            attention.head_size,
        )
        self.layers = config["num_hidden_layers"]
        self.eps = float(config.get("norm_epsilon", 1e-5))
        self.learned_positions = config.get("position_embedding_type") == "learned_absolute"
        self.act = _ACTIVATIONS.get(config.get("hidden_act", "silu"))
        if self.act is None:
            raise InputError(
                f"hidden_act {config.get('hidden_act')!r} is not supported by the checkpoint runtime"
            )
        self.gated = "transformer.layers.0.mlp.gate.weight" in self.w
        self.qk_norm = "transformer.layers.0.attention.q_layernorm.weight" in self.w
        rot_dim = int(
            config.get("rotary_embedding_dim") or self.head * float(config.get("rotary_pct", 1.0))
        )
        self.inv_freq = rope_inv_freq(
            rot_dim, float(config.get("rotary_base") or 10000.0), config.get("rotary_scaling")
        ).to(device)
        self._dense = {name: self._dequantize(name) for name in self.w}

    @classmethod
    def load(cls, checkpoint: Path, device: str = "cpu") -> CheckpointRuntime:
        config, weights = read_checkpoint(checkpoint)
        return cls(config, weights, device)

    # -- numerics ---------------------------------------------------------------------------
    def _dequantize(self, name: str) -> torch.Tensor:
        """A weight as float32 (e4m3: as fp8_matmul sums), INT8-rounded where the engine rounds it."""
        w = self.w[name]
        if w.dtype == torch.int8 and self.smoothquant:
            return w.float()  # exact integers; the scales are applied around the GEMM
        if w.dtype == E4M3:  # in the simulated GEMM's dtype; the tensor cores read it as stored
            return w if fp8_kernel_runs(w.device) else w.to(simulation_dtype(w.device))
        if w.dtype == torch.uint8 and self.fp4:  # exact in float32: e2m1 x e4m3 x float32
            base = name.removesuffix(".weight")
            return nvfp4.dequantize(nvfp4.unpack_columns(w), self.w[f"{base}.weights_scaling_factor"],
                                    self.w[f"{base}.weights_scaling_factor_2"])  # fmt: skip
        if w.dtype == torch.int8 and self.int4:
            base = name.removesuffix(".weight")
            scales = self.w[base + ".weights_scaling_factor"]
            if self.w4a8:  # the e4m3 weight the GEMM multiplies, as the FP8 checkpoint's is kept
                w8 = w4a8.fp8_weight(int4.unpack_rows(w), scales,
                                     self.w[base + ".weights_scaling_factor_2"], self.dtype,
                                     engine=self.engine_inputs)  # fmt: skip
                return w8 if fp8_kernel_runs(w8.device) else w8.to(simulation_dtype(w8.device))
            return int4.dequantize(int4.unpack_rows(w), scales, self.dtype)
        if w.dtype == torch.int8 and self.weight_only and name.endswith(WEIGHT_ONLY_LINEARS):
            scale = self.w.get(name.removesuffix(".weight") + WEIGHT_SCALE)
            if scale is not None:  # the llmapi checkpoint's INT8 values: as its GEMM reads them
                return w.float() * scale.float()[:, None]
        if w.dtype == torch.int8:
            raise InputError(
                f"{name} is stored as int8: pre-quantized W8A16 files are GPU-specific; convert with trt-builder"
            )
        if self.weight_only and name.endswith(WEIGHT_ONLY_LINEARS):
            return weight_only_int8(w, self.dtype)
        return w.float()

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        """Store x as the engine would (checkpoint dtype), keep computing in float32."""
        return x if self.dtype == torch.float32 else x.to(self.dtype).float()

    def _linear(self, x: torch.Tensor, name: str, *, fixed: bool = False) -> torch.Tensor:
        """x @ W.T (+ bias) as the engine stores it; `fixed`: on blocks of DECODE_ROWS rows
        (the SmoothQuant GEMM needs none: its int32 accumulation is exact at any shape)."""
        if self.smoothquant and self.w[name + ".weight"].dtype == torch.int8:
            return self._sq_linear(x, name)
        if self.w[name + ".weight"].dtype == E4M3:
            return self._fp8_linear(x, name, fixed=fixed)
        if self.w4a8 and self.w[name + ".weight"].dtype == torch.int8:
            return self._w4a8_linear(x, name, fixed=fixed)
        weight = self._dense[name + ".weight"]
        if self.fp4 and self.w[name + ".weight"].dtype == torch.uint8:  # the FP4 GEMM's input
            x = nvfp4.fake_quantize(x, self.w[name + ".activation_scaling_factor"])
        pre_quant = self._dense.get(name + ".prequant_scaling_factor")
        if pre_quant is not None:  # AWQ's input scale, applied in the model dtype
            x = self._round(x * pre_quant)
        y = _fixed_rows_matmul(x, weight) if fixed else x @ weight.T
        bias = self._dense.get(name + ".bias")
        return self._round(y if bias is None else y + bias)

    def _sq_linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The SmoothQuant plugin GEMM: int8 activations (per token, or one static scale) times
        int8 weights, int32 accumulation, then per-channel and activation scales."""
        layer, sep, linear = name.rpartition(".attention.")
        if not sep:
            layer, sep, linear = name.rpartition(".mlp.")
        d = self._dense
        if linear in ("dense", "proj"):  # the smoother is divided out of the activation
            x = self._round(x / self._round(d[f"{name}.smoother"]))
            block = "attention" if linear == "dense" else "mlp"
            static = d.get(f"{layer}.{block}.quantization_scaling_factor")
        else:
            norm = "input_layernorm" if linear == "qkv" else "post_layernorm"
            static = d.get(f"{layer}.{norm}.scale_to_int")
        if self.per_token:
            q, row_scale = quantize_tokens(x)
        else:
            assert static is not None
            q = quantize_static(x, static)
            row_scale = d[f"{name}.act_scale"].reshape(())
        acc = int8_matmul(q, self.w[f"{name}.weight"])  # int32 accumulation, exact
        y = acc * d[f"{name}.per_channel_scale"].reshape(-1) * row_scale
        bias = d.get(name + ".bias")
        return self._round(y if bias is None else y + bias)

    def _fp8_linear(self, x: torch.Tensor, name: str, *, fixed: bool = False) -> torch.Tensor:
        """TensorRT-LLM's FP8Linear: e4m3(x / a) times the e4m3 weight, float32 sums scaled by
        a * w (runtimes/fp8.py); `fixed`: on DECODE_ROWS-row blocks (the float32 sums, like a
        float GEMM's, follow the kernel the shape picks)."""
        d = self._dense
        a, ws = d[f"{name}.activation_scaling_factor"], d[f"{name}.weights_scaling_factor"]
        weight, stored = self.w[f"{name}.weight"], d[f"{name}.weight"]
        w_float = None if stored.dtype == E4M3 else stored

        def gemm(rows: torch.Tensor) -> torch.Tensor:
            return fp8_matmul(to_e4m3(rows, a), weight, a, ws, w_float=w_float)

        flat = x.reshape(-1, x.shape[-1])
        y = (_in_blocks(gemm, flat) if fixed else gemm(flat)).reshape(*x.shape[:-1], -1)
        bias = d.get(name + ".bias")
        return self._round(y if bias is None else y + bias)

    def _w4a8_linear(self, x: torch.Tensor, name: str, *, fixed: bool = False) -> torch.Tensor:
        """TensorRT-LLM's W4A(fp)8 GEMM (checkpoint/w4a8.py): the input times its
        pre-quantization scale, e4m3 at the input scale a; the e4m3 weight; float32 sums scaled
        by a * s2 (runtimes/fp8.py, exact on the CPU)."""
        d = self._dense
        a, s2 = d[f"{name}.activation_scaling_factor"], d[f"{name}.weights_scaling_factor_2"]
        pqs, stored = d.get(f"{name}.prequant_scaling_factor"), d[f"{name}.weight"]
        w_float = None if stored.dtype == E4M3 else stored

        def gemm(rows: torch.Tensor) -> torch.Tensor:
            xq = w4a8.w4a8_input(rows, pqs, a, self.dtype, engine=self.engine_inputs)
            return fp8_matmul(xq, stored, a, s2, w_float=w_float)

        flat = x.reshape(-1, x.shape[-1])
        y = (_in_blocks(gemm, flat) if fixed else gemm(flat)).reshape(*x.shape[:-1], -1)
        bias = d.get(name + ".bias")
        return self._round(y if bias is None else y + bias)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight, bias = self._dense[name + ".weight"], self._dense.get(name + ".bias")
        if bias is not None:  # LayerNorm
            return self._round(F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps))
        var = x.pow(2).mean(-1, keepdim=True)
        return self._round(x * torch.rsqrt(var + self.eps) * weight)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [batch, heads, tokens, head], positions [batch, tokens]."""
        angles = positions.float()[..., None] * self.inv_freq  # [batch, tokens, rot / 2]
        emb = torch.cat((angles, angles), dim=-1)[:, None]
        rot = emb.shape[-1]
        xr, xp = x[..., :rot], x[..., rot:]
        out = xr * emb.cos() + _rotate_half(xr) * emb.sin()
        return torch.cat((out, xp), dim=-1)

    def _qkv(
        self, p: str, h: torch.Tensor, positions: torch.Tensor, *, fixed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [batch, heads, tokens, head] of h [batch, tokens, hidden], q/k-normed and
        rotated; `fixed`: the GEMM and the norms on DECODE_ROWS-row blocks (decode)."""
        qkv = self._linear(h, f"{p}.qkv", fixed=fixed)
        b, t = h.shape[:2]
        q_dim, kv_dim = self.heads * self.head, self.kv_heads * self.head
        q = qkv[..., :q_dim].reshape(b, t, self.heads, self.head).transpose(1, 2)
        k = qkv[..., q_dim : q_dim + kv_dim].reshape(b, t, self.kv_heads, self.head).transpose(1, 2)
        v = qkv[..., q_dim + kv_dim :].reshape(b, t, self.kv_heads, self.head).transpose(1, 2)
        if self.qk_norm:
            blocks = _in_blocks if fixed else (lambda fn, x: fn(x))
            q = blocks(lambda x: self._norm(x, f"{p}.q_layernorm"), q)
            k = blocks(lambda x: self._norm(x, f"{p}.k_layernorm"), k)
        if not self.learned_positions:
            q, k = self._round(self._rope(q, positions)), self._round(self._rope(k, positions))
        return q, k, v

    def _attention(
        self, i: int, h: torch.Tensor, cache: KVCache, positions: torch.Tensor
    ) -> torch.Tensor:
        p = f"transformer.layers.{i}.attention"
        q, k, v = self._qkv(p, h, positions)
        b, t = h.shape[:2]
        q_dim = self.heads * self.head
        # The INT8 KV cache holds round(k / s) and reads back int8 * s; the tokens of this step
        # attend to their own K/V unquantized, as the engine does.
        stored_k, stored_v = self._kv_store(i, k), self._kv_store(i, v)
        if len(cache.keys) > i:
            past_k, past_v = cache.keys[i], cache.values[i]
            cache.keys[i] = torch.cat((past_k, stored_k), dim=2)
            cache.values[i] = torch.cat((past_v, stored_v), dim=2)
            k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        else:
            cache.keys.append(stored_k)
            cache.values.append(stored_v)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self._mask(cache, t, k.shape[2]), enable_gqa=True
        )
        attn = self._round(attn.transpose(1, 2).reshape(b, t, q_dim))
        return self._linear(attn, f"{p}.dense")

    def _attention_rows(
        self, i: int, h: torch.Tensor, caches: list[KVCache], positions: torch.Tensor
    ) -> torch.Tensor:
        """Attention for one new token of each sequence, h [batch, 1, hidden]: the GEMMs on
        fixed row blocks, each row's attention over its own cache alone (no padding: a padded
        batch would change every row's reductions)."""
        p = f"transformer.layers.{i}.attention"
        q, k, v = self._qkv(p, h, positions, fixed=True)
        b, q_dim = h.shape[0], self.heads * self.head
        rows = []
        for row, cache in enumerate(caches):
            k_row, v_row = k[row : row + 1], v[row : row + 1]
            past_k, past_v = cache.keys[i], cache.values[i]
            cache.keys[i] = torch.cat((past_k, self._kv_store(i, k_row)), dim=2)
            cache.values[i] = torch.cat((past_v, self._kv_store(i, v_row)), dim=2)
            rows.append(F.scaled_dot_product_attention(
                q[row : row + 1], torch.cat((past_k, k_row), dim=2),
                torch.cat((past_v, v_row), dim=2), enable_gqa=True))  # fmt: skip
        attn = self._round(torch.cat(rows).transpose(1, 2).reshape(b, 1, q_dim))
        return self._linear(attn, f"{p}.dense", fixed=True)

    def _kv_store(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """What the KV cache gives back of x: INT8, round(x / s) * s; FP8, e4m3(x / s) * s
        (saturating, as the engine's cast does); else x."""
        if not (self.kv_int8 or self.kv_fp8):
            return x
        scale = self._dense[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"].reshape(())
        if self.kv_fp8:
            return self._round(to_e4m3(x, scale).float() * scale)
        return self._round(torch.round(x / scale).clamp(-128, 127) * scale)

    def _mask(self, cache: KVCache, t: int, total: int) -> torch.Tensor:
        """[batch, 1, t, total]: causal, left padding hidden (a padding query sees itself, so
        its row is never empty; its output is ignored)."""
        past = total - t
        causal = torch.ones(t, total, dtype=torch.bool, device=self.device).tril(diagonal=past)
        if cache.pad is None or not bool(cache.pad.any()):
            return causal[None, None]
        keys = torch.arange(total, device=self.device)
        visible = causal[None] & (keys[None, None, :] >= cache.pad[:, None, None])
        own = keys[None, None, :] == torch.arange(past, total, device=self.device)[None, :, None]
        return (visible | own)[:, None]

    def _mlp(self, i: int, h: torch.Tensor, *, fixed: bool = False) -> torch.Tensor:
        p = f"transformer.layers.{i}.mlp"
        act = self.act(self._linear(h, f"{p}.fc", fixed=fixed))  # type: ignore[misc]
        if self.gated:
            act = act * self._linear(h, f"{p}.gate", fixed=fixed)
        return self._linear(self._round(act), f"{p}.proj", fixed=fixed)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        pad: torch.Tensor | None = None,
        hidden: list[torch.Tensor] | None = None,
        last: bool = False,
    ) -> torch.Tensor:
        """Logits (float32) for `ids` appended after what `cache` holds: [tokens, vocab] for
        one sequence of [tokens], [batch, tokens, vocab] for a batch; with `last`, for the last
        token alone (a prefill needs no more, and lm_head is a fifth of the model). A batch is
        left-padded: `pad` (on the first call) gives each sequence's count of padding tokens.
        `hidden`, if given, receives the residual stream after each layer, then the final
        norm's output."""
        cache = cache if cache is not None else KVCache()
        single = ids.dim() == 1
        ids = (ids[None] if single else ids).to(self.device)
        if cache.pad is None:
            cache.pad = (
                torch.zeros(ids.shape[0], dtype=torch.long) if pad is None else pad.long()
            ).to(self.device)
        steps = torch.arange(cache.length, cache.length + ids.shape[1], device=self.device)
        positions = (steps[None] - cache.pad[:, None]).clamp(min=0)
        x = self._dense["transformer.vocab_embedding.weight"][ids]
        if self.learned_positions:
            x = x + self._dense["transformer.position_embedding.weight"][positions]
        x = self._round(x)
        for i in range(self.layers):
            lp = f"transformer.layers.{i}"
            x = self._round(
                x + self._attention(i, self._norm(x, f"{lp}.input_layernorm"), cache, positions)
            )
            x = self._round(x + self._mlp(i, self._norm(x, f"{lp}.post_layernorm")))
            if hidden is not None:
                hidden.append(x[0] if single else x)
        x = self._norm(x, "transformer.ln_f")
        if hidden is not None:
            hidden.append(x[0] if single else x)
        if last:
            x = x[:, -1:]
        logits = (x @ self._dense["lm_head.weight"].T).float()
        return logits[0] if single else logits

    @torch.inference_mode()
    def decode(self, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
        """Logits [len(tokens), vocab] (float32) of the next token of each of several sequences,
        each fed its last token after what its own cache holds (the caches of unpadded,
        single-sequence forwards; each gets the token appended). Batch-invariant: a sequence's
        logits are bit for bit those it gets decoded alone, whatever shares the step (float
        GEMMs and norms on DECODE_ROWS-row blocks, attention row by row)."""
        ids = torch.tensor(tokens, device=self.device)[:, None]
        positions = torch.tensor([[c.length] for c in caches], device=self.device)
        assert all(c.pad is None or not bool(c.pad.any()) for c in caches), "padded cache"
        x = self._dense["transformer.vocab_embedding.weight"][ids]
        if self.learned_positions:
            x = x + self._dense["transformer.position_embedding.weight"][positions]
        x = self._round(x)

        def norm(t: torch.Tensor, name: str) -> torch.Tensor:
            return _in_blocks(lambda block: self._norm(block, name), t)

        for i in range(self.layers):
            lp = f"transformer.layers.{i}"
            h = norm(x, f"{lp}.input_layernorm")
            x = self._round(x + self._attention_rows(i, h, caches, positions))
            x = self._round(x + self._mlp(i, norm(x, f"{lp}.post_layernorm"), fixed=True))
        x = norm(x, "transformer.ln_f")
        return _fixed_rows_matmul(x[:, 0], self._dense["lm_head.weight"]).float()

    @torch.inference_mode()
    def forward_decoded(self, ids: torch.Tensor, prefix: int) -> torch.Tensor:
        """Logits for a batch of `ids` [batch, tokens] as generation computes them: the first
        `prefix` tokens in one prefill, every later one fed alone through the KV cache (where
        the INT8 KV cache's rounding shows: a prefill attends to its own K/V unquantized)."""
        cache = KVCache()
        steps = [self.forward(ids[:, :prefix], cache)]
        steps += [self.forward(ids[:, t : t + 1], cache) for t in range(prefix, ids.shape[1])]
        return torch.cat(steps, dim=1)

    @torch.inference_mode()
    def greedy(self, ids: list[int], max_new_tokens: int, end_ids: set[int]) -> list[int]:
        """Greedy continuation of one prompt with a KV cache; stops after an end id."""
        return self.greedy_batch([ids], max_new_tokens, end_ids)[0]

    @torch.inference_mode()
    def greedy_batch(
        self, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int = 0
    ) -> list[list[int]]:
        """Greedy continuations of a batch of prompts, each stopping after its first end id:
        each prompt prefilled alone, then decoded together (decode: the same tokens as each
        alone, and as the reference backend answers at any load). Nothing is padded, so
        `pad_id` (the runtimes' common signature) is not used."""
        caches = [KVCache() for _ in prompts]
        logits = torch.stack([self.forward(torch.tensor(p), c, last=True)[-1]
                              for p, c in zip(prompts, caches, strict=True)])  # fmt: skip
        out: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            tokens = logits.argmax(-1).tolist()
            for row, token in zip(active, tokens, strict=True):
                out[row].append(token)
            active = [r for r, t in zip(active, tokens, strict=True) if t not in end_ids]
            if not active or len(out[active[0]]) >= max_new_tokens:
                break
            logits = self.decode([out[r][-1] for r in active], [caches[r] for r in active])
        return out
