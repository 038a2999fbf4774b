"""Tensor- and pipeline-parallel ranks in TensorRT-LLM's checkpoint layout.

A rank is `pp_rank * tp + tp_rank`. Within tensor parallelism, a tensor is split by what it is
(its name's suffix): QKV per head group (KV heads duplicated when there are fewer than ranks),
column-parallel layers on the output dim, row-parallel layers on the input dim, lm_head on the
vocabulary after padding it to a multiple of tp; everything else (norms, embeddings, row
biases) is replicated. Pipeline ranks hold contiguous layer ranges, renumbered from 0, the
embeddings on the first rank and ln_f/lm_head on the last.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from .mapping import Mapping

#: TensorRT-LLM's tensor-parallel kind by tensor-name suffix (TL convert_utils); default replicated.
TP_KIND: tuple[tuple[str, str], ...] = (
    ("attention.qkv.weight", "qkv"),
    ("attention.qkv.bias", "qkv"),
    ("attention.dense.weight", "row"),
    ("mlp.fc.weight", "column"),
    ("mlp.fc.bias", "column"),
    ("mlp.gate.weight", "column"),
    ("mlp.gate.bias", "column"),
    ("mlp.proj.weight", "row"),
    ("lm_head.weight", "vocab"),
    # SmoothQuant's [1, n] vectors: scales of column-parallel outputs follow their rows;
    # smoothers of row-parallel inputs their columns; the rest is replicated
    ("attention.qkv.per_channel_scale", "qkv_vector"),
    ("mlp.fc.per_channel_scale", "column_vector"),
    ("mlp.gate.per_channel_scale", "column_vector"),
    ("attention.dense.smoother", "row"),
    ("mlp.proj.smoother", "row"),
    # INT4's group scales [out, in / group] follow their weight's rows or columns; AWQ's
    # pre-quantization scales [in] of row-parallel inputs their columns; the rest (per-tensor
    # scales of one element: FP8's) is replicated
    ("attention.qkv.weights_scaling_factor", "qkv"),
    ("mlp.fc.weights_scaling_factor", "column"),
    ("mlp.gate.weights_scaling_factor", "column"),
    ("attention.dense.weights_scaling_factor", "row"),
    ("mlp.proj.weights_scaling_factor", "row"),
    ("attention.dense.prequant_scaling_factor", "row_vector"),
    ("mlp.proj.prequant_scaling_factor", "row_vector"),
)
FIRST_STAGE = ("transformer.vocab_embedding.", "transformer.position_embedding.")
LAST_STAGE = ("transformer.ln_f.", "lm_head.")
_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")


def tp_kind(name: str, tensor: torch.Tensor | None = None) -> str:
    """How tensor `name` is split; a tensor of one element (a per-tensor scale) is replicated
    whatever its name."""
    if tensor is not None and tensor.numel() == 1:
        return "replicated"
    return next((kind for suffix, kind in TP_KIND if name.endswith(suffix)), "replicated")


def _split_qkv(parts: list[torch.Tensor], m: Mapping) -> list[list[torch.Tensor]]:
    """Per tp rank, its [q, k, v] rows (views where possible) from q, k, v or a fused qkv."""
    if len(parts) == 1:
        q_rows, kv_rows = m.heads * m.head_size, m.kv_heads * m.head_size
        parts = list(parts[0].split([q_rows, kv_rows, kv_rows], dim=0))
    q, k, v = parts
    if m.kv_heads < m.tp:  # each KV head serves tp // kv ranks: repeat it
        rep = m.tp // m.kv_heads
        k = (
            k.reshape(m.kv_heads, m.head_size, *k.shape[1:])
            .repeat_interleave(rep, 0)
            .reshape(-1, *k.shape[1:])
        )
        v = (
            v.reshape(m.kv_heads, m.head_size, *v.shape[1:])
            .repeat_interleave(rep, 0)
            .reshape(-1, *v.shape[1:])
        )
    return [list(p) for p in zip(q.chunk(m.tp, 0), k.chunk(m.tp, 0), v.chunk(m.tp, 0), strict=True)]


def split_tp(name: str, t: torch.Tensor, m: Mapping) -> list[torch.Tensor]:
    """The tp pieces of one full tensor, in tp-rank order."""
    if m.tp == 1:
        return [t]
    kind = tp_kind(name, t)
    if kind == "qkv":
        return [torch.cat(p, dim=0) for p in _split_qkv([t], m)]
    if kind == "qkv_vector":
        return [torch.cat(p, dim=0).reshape(1, -1) for p in _split_qkv([t.reshape(-1)], m)]
    if kind == "column_vector":
        return list(t.chunk(m.tp, 1))
    if kind == "column":
        return list(t.chunk(m.tp, 0))
    if kind == "row":
        return list(t.chunk(m.tp, 1))
    if kind == "row_vector":
        return list(t.chunk(m.tp, -1))
    if kind == "vocab":
        pad = m.padded_vocab - t.shape[0]
        padded = F.pad(t, (0, 0, 0, pad)) if pad else t
        return list(padded.chunk(m.tp, 0))
    return [t] * m.tp


def place(name: str, m: Mapping) -> list[tuple[int, str]]:
    """(pp rank, name on that rank) for a full-model tensor name."""
    match = _LAYER.match(name)
    if match:
        layer = int(match.group(1))
        pp_rank = layer // (m.layers // m.pp)
        local = layer - m.layer_range(pp_rank).start
        return [(pp_rank, f"transformer.layers.{local}.{match.group(2)}")]
    if name.startswith(FIRST_STAGE):
        return [(0, name)]
    if name.startswith(LAST_STAGE):
        return [(m.pp - 1, name)]
    raise ValueError(f"{name}: no pipeline placement rule")


def shard(
    name: str, parts: list[torch.Tensor], m: Mapping
) -> list[tuple[int, str, list[torch.Tensor]]]:
    """(rank, name, pieces) for every rank that holds part of tensor `name`, given as `parts`
    concatenated on dim 0 (q, k, v); each rank's tensor is its pieces concatenated on dim 0.
    Pieces are views where the split allows, so the writer's copy is the only one."""
    if m.tp == 1:
        per_rank = [list(parts)]  # q, k and v go to their rows of qkv directly
    elif tp_kind(name, parts[0]) == "qkv":
        per_rank = _split_qkv(parts, m)
    else:
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        per_rank = [[piece] for piece in split_tp(name, full, m)]
    return [
        (pp_rank * m.tp + tp_rank, local, pieces)
        for pp_rank, local in place(name, m)
        for tp_rank, pieces in enumerate(per_rank)
    ]


def merge(ranks: list[dict[str, torch.Tensor]], m: Mapping) -> dict[str, torch.Tensor]:
    """Reassemble rank tensors into the TP=1, PP=1 checkpoint (inverse of `shard`)."""
    merged: dict[str, torch.Tensor] = {}
    for pp_rank in range(m.pp):
        group = ranks[pp_rank * m.tp : (pp_rank + 1) * m.tp]
        offset = m.layer_range(pp_rank).start
        for local in group[0]:
            match = _LAYER.match(local)
            name = (
                f"transformer.layers.{int(match.group(1)) + offset}.{match.group(2)}"
                if match
                else local
            )
            merged[name] = _merge_tp(name, [g[local] for g in group], m)
    return merged


def _merge_tp(name: str, pieces: list[torch.Tensor], m: Mapping) -> torch.Tensor:
    if m.tp == 1:
        return pieces[0]
    kind = tp_kind(name, pieces[0])
    if kind == "column":
        return torch.cat(pieces, 0)
    if kind == "column_vector":
        return torch.cat(pieces, 1)
    if kind == "qkv_vector":
        return _merge_tp(name.removesuffix("per_channel_scale") + "weight",
                         [p.reshape(-1) for p in pieces], m).reshape(1, -1)  # fmt: skip
    if kind == "row":
        return torch.cat(pieces, 1)
    if kind == "row_vector":
        return torch.cat(pieces, -1)
    if kind == "vocab":
        return torch.cat(pieces, 0)[: m.vocab]
    if kind == "qkv":
        q_rows = m.heads * m.head_size // m.tp
        kv_rows = (pieces[0].shape[0] - q_rows) // 2
        split = [p.split([q_rows, kv_rows, kv_rows], dim=0) for p in pieces]
        q = torch.cat([s[0] for s in split], 0)
        k = torch.cat([s[1] for s in split], 0)
        v = torch.cat([s[2] for s in split], 0)
        if m.kv_heads < m.tp:  # undo the duplication: keep one copy of each KV head
            rep = m.tp // m.kv_heads
            k = k.reshape(m.tp, m.head_size, *k.shape[1:])[::rep].reshape(-1, *k.shape[1:])
            v = v.reshape(m.tp, m.head_size, *v.shape[1:])[::rep].reshape(-1, *v.shape[1:])
        return torch.cat([q, k, v], 0)
    return pieces[0]
