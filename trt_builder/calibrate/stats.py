"""Calibration: activation statistics of the transformers model over a calibration set.

For every linear layer of the decoder: the absolute maximum of its input per input channel (what
SmoothQuant's smoother and static activation scales need), the mean square of its input per
input channel over every token (INT8 weight-only clipping weighs each weight column's error by
it, trt_builder/modes/weight_only/convert.py), and the absolute maximum of its output per output channel
(static output scales take their maximum; the INT8 KV cache balances K and V channels with the
q/k/v_proj ones, docs/quantization.md). The statistics are an artifact of their own
(`calibration.safetensors` + `calibration.json`), keyed by the model, the calibration set and
the sampling knobs only: changing alpha, granularity, clipping or the KV-cache choice reuses
them.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.weights import weight_files
from ..core.errors import InputError
from ..models.family import Family
from ..models.registry import family_for
from ..source.files import read_hf_config
from ..source.hf import load_hf_model, pick_device
from ..spec.build import CalibrationOptions
from .corpus import load_texts, make_samples

#: calibration.safetensors' metadata key: {module path: the file's name} where they differ.
FILE_NAMES = "file_names"


class _Recorder:
    """Forward hooks on the decoder's linear layers (where the family's registry entry says its
    decoder layers and vision tower are): running absmax per channel of inputs and of outputs,
    and a running sum of squares (float64) and token count of inputs."""

    def __init__(self, model: torch.nn.Module, family: Family) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.squares: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}  # from shapes: counting needs no synchronisation
        self.handles = []
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        decoder = re.compile(family.decoder_layer)
        for name, module in model.named_modules():
            if (
                isinstance(module, (torch.nn.Linear, Conv1D))
                and decoder.search(name)
                and not name.startswith(family.vision_tower)
            ):
                self.handles.append(module.register_forward_hook(self._hook(name)))
        if not self.handles:
            raise InputError("the model has no decoder linear layers to calibrate")

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            # kept where the layer runs (no synchronisation per call); moved to the CPU once
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            y = output.detach()
            ax = x.abs().amax(dim=0).float()
            ay = y.abs().reshape(-1, y.shape[-1]).amax(dim=0).float()
            sq = x.float().square().sum(dim=0).double()  # float32 within a batch, float64 across
            if name in self.inputs:
                torch.maximum(self.inputs[name], ax, out=self.inputs[name])
                torch.maximum(self.outputs[name], ay, out=self.outputs[name])
                self.squares[name] += sq
                self.tokens[name] += x.shape[0]
            else:
                self.inputs[name], self.outputs[name] = ax, ay
                self.squares[name], self.tokens[name] = sq, x.shape[0]

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{n}.input_absmax": t.cpu() for n, t in self.inputs.items()}
        out.update({f"{n}.output_absmax": t.cpu() for n, t in self.outputs.items()})
        for n, total in self.squares.items():
            out[f"{n}.input_sqmean"] = (total / self.tokens[n]).float().cpu()
        return out


def file_names(modules: set[str], files: list[Path], family: Family) -> dict[str, str]:
    """The checkpoint file's name of each linear in `modules` (transformers module paths) that
    the files do not name as its module (Family.same_linear: a hub-layout Qwen2.5-VL, the hub's
    GPT-2); a module matched by none is left out (convert names what it misses)."""
    from ..checkpoint.safetensors_io import SafetensorsIndex

    weights = [k.removesuffix(".weight") for k in SafetensorsIndex(files).names()
               if k.endswith(".weight")]  # fmt: skip
    present = set(weights)
    out: dict[str, str] = {}
    for module in sorted(modules - present):
        found = family.same_linear(module, weights)
        if found is not None:
            out[module] = found
    return out


def collect(
    model: torch.nn.Module, ids: torch.Tensor, batch_size: int, family: Family
) -> dict[str, torch.Tensor]:
    """Run `model` over the [samples, seq_len] ids in batches; the statistics by name."""
    recorder = _Recorder(model, family)
    first = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for row in range(0, ids.shape[0], batch_size):
                model(ids[row : row + batch_size].to(first), use_cache=False, logits_to_keep=1)
    finally:
        recorder.close()
    return recorder.tensors()


def load_model(hf_dir: Path, device: str, offload: Path, dtype: torch.dtype | None = None) -> Any:
    """The transformers model on `device`: on cuda across every GPU, spilling to CPU memory
    and then to `offload` on disk (accelerate); on the CPU in `dtype`, float32 unless given."""

    if device == "cuda":  # every GPU, spilling to CPU memory and then to disk (accelerate)
        offload.mkdir(parents=True, exist_ok=True)
        return load_hf_model(hf_dir, dtype=load_dtype(device, dtype), device_map="auto",
                             offload_folder=str(offload))  # fmt: skip
    return load_hf_model(hf_dir, dtype=load_dtype(device, dtype))


def load_dtype(device: str, dtype: torch.dtype | None) -> torch.dtype | str:
    """What transformers loads the model in: `dtype` where given, else the stored dtype on
    cuda ("auto") and float32 on the CPU."""
    return dtype or ("auto" if device == "cuda" else torch.float32)


def calibration_dtype(device: str) -> torch.dtype | None:
    """The dtype the calibration runs the model in where it is not `load_model`'s: bfloat16 on
    a CPU that computes it natively (AVX-512 BF16, AMX; oneDNN says so), where it halves the
    time of float32 (SmolLM2, 2 cores: 16 s against 33 s) and moves the statistics by about 0.5%
    (the median over channels; docs/benchmarks.md). On the GPU the model dtype is used anyway."""
    if device == "cpu" and torch.backends.mkldnn.is_available():
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.bfloat16
    return None


def calibrate(hf_dir: Path, out_dir: Path, options: CalibrationOptions) -> dict[str, Any]:
    """Run the model over the calibration set one decoder layer at a time (layers.py: the
    statistics are the whole model's, bit for bit) and write them into `out_dir`."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .layers import LayerByLayer

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    device = pick_device(options.device)
    texts, digest = load_texts(options.dataset)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = make_samples(tokenizer, texts, options)
    family = family_for(read_hf_config(hf_dir))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with LayerByLayer(
        hf_dir, device, load_dtype(device, calibration_dtype(device)), family
    ) as model:
        recorder = _Recorder(model.model, family)
        try:
            model.run(model.start(ids, options.batch_size))
        finally:
            recorder.close()
        stats = recorder.tensors()
        dtype = str(next(model.model.parameters()).dtype).removeprefix("torch.")
    modules = {k.rsplit(".", 1)[0] for k in stats}
    names = file_names(modules, weight_files(hf_dir), family)
    save_file({k: v.contiguous() for k, v in sorted(stats.items())}, str(out_dir / "calibration.safetensors"),
              metadata={"format": "pt", FILE_NAMES: json.dumps(names, sort_keys=True)})  # fmt: skip
    summary = {
        **asdict(options),
        "device": device,
        "dtype": dtype,
        "dataset_digest": digest,
        "documents": len(texts),
        "tokens": int(ids.numel()),
        "linears": sum(name.endswith(".input_absmax") for name in stats),
        "seconds": round(time.perf_counter() - start, 2),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }
    (out_dir / "calibration.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def load_stats(directory: Path, *, modules: bool = False) -> dict[str, torch.Tensor]:
    """The statistics of a calibration directory, by `<HF linear>.input_absmax`, `.input_sqmean`
    and `.output_absmax`: each linear under the checkpoint file's name of its weight (what
    convert reads), or with `modules`, under its transformers module path (what runs the model:
    the recipe's searches)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = directory / "calibration.safetensors"
    if not path.is_file():
        raise InputError(f"{directory} holds no calibration: run trt-builder calibrate")
    stats = load_file(path)
    if modules:
        return stats
    with safe_open(str(path), "pt") as f:
        names = json.loads((f.metadata() or {}).get(FILE_NAMES) or "{}")
    out = {}
    for key, value in stats.items():
        module, stat = key.rsplit(".", 1)
        out[f"{names.get(module, module)}.{stat}"] = value
    return out
