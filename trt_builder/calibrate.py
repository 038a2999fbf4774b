"""Calibration: activation statistics of the transformers model over a calibration set.

For every linear layer of the decoder: the absolute maximum of its input per input channel (what
SmoothQuant's smoother and static activation scales need) and of its output per output channel
(static output scales take their maximum; the INT8 KV cache balances K and V channels with the
q/k/v_proj ones, docs/quantization.md). The statistics are an artifact of their own
(`calibration.safetensors` + `calibration.json`), keyed by the model, the calibration set and
the sampling knobs only: changing alpha, granularity or the KV-cache choice reuses them.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .spec import BUNDLED, CalibrationOptions

#: A linear inside a decoder layer (`model.layers.N.`, GPT-2's `transformer.h.N.`).
_DECODER_LAYER = re.compile(r"\.(layers|h)\.\d+\.")


def bundled_texts(split: str) -> list[str]:
    """The documents of one split of the bundled corpus: calibration, search or heldout."""
    path = resources.files("trt_builder").joinpath(f"data/corpus/{split}.jsonl")
    return _jsonl(path.read_text("utf-8"), f"the bundled {split} set")


def load_texts(dataset: str) -> tuple[list[str], str]:
    """(documents, a digest of them) of a calibration set."""
    if dataset == BUNDLED:
        texts = bundled_texts("calibration")
    elif dataset.startswith("hf:"):
        texts = _hf_dataset(dataset.removeprefix("hf:"))
    else:
        path = Path(dataset)
        if not path.is_file():
            raise InputError(
                f"calibration set {dataset} is not a file: give a .txt or .jsonl file, "
                "'bundled', or hf:NAME for a Hugging Face dataset"
            )
        raw = path.read_text("utf-8", errors="replace")
        if path.suffix == ".jsonl":
            texts = _jsonl(raw, path.name)
        else:  # plain text: documents are separated by blank lines
            texts = [t.strip() for t in raw.split("\n\n") if t.strip()]
    if not texts:
        raise InputError(f"calibration set {dataset} holds no text")
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
    return texts, digest


def _jsonl(raw: str, what: str) -> list[str]:
    texts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            texts.append(str(row["text"]))
        except (ValueError, KeyError, TypeError):
            raise InputError(
                f'{what} line {number} is not a JSON object with a "text" field: fix that line'
            ) from None
    return texts


def _hf_dataset(spec: str) -> list[str]:
    name, _, rest = spec.partition(":")
    split, _, field = rest.partition(":")
    try:
        import datasets
    except ImportError:
        raise InputError(
            "an hf: calibration set needs the datasets package: pip install datasets (or give a "
            ".txt / .jsonl file)"
        ) from None
    try:
        rows = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:  # datasets raises many kinds; offline is the usual one
        raise InputError(
            f"cannot load dataset {name} ({exc}): check the name, or work online"
        ) from None
    column = field or "text"
    if column not in rows.column_names:
        raise InputError(
            f"dataset {name} has no {column!r} column: name one as hf:{name}:{split or 'train'}:COLUMN"
        )
    return [str(t) for t in rows[column] if str(t).strip()]


def make_samples(tokenizer: Any, texts: list[str], options: CalibrationOptions) -> torch.Tensor:
    """[samples, seq_len] token ids: documents shuffled by the seed, joined with the end id,
    cut into windows."""
    order = list(range(len(texts)))
    random.Random(options.seed).shuffle(order)
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    need = options.samples * options.seq_len
    for i in order:
        stream += tokenizer(texts[i], add_special_tokens=False).input_ids + [sep]
        if len(stream) >= need:
            break
    have = len(stream) // options.seq_len
    if have < options.samples:
        raise InputError(
            f"the calibration set gives only {have} samples of {options.seq_len} tokens: lower "
            f"--calib-samples or --calib-seq-len, or give more text"
        )
    return torch.tensor(stream[:need]).view(options.samples, options.seq_len)


class _Recorder:
    """Forward hooks on the decoder's linear layers: running absmax per channel of inputs and of
    outputs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = []
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        for name, module in model.named_modules():
            if (
                isinstance(module, (torch.nn.Linear, Conv1D))
                and _DECODER_LAYER.search(f".{name}.")
                and not any(part in name for part in ("visual", "vision"))
            ):
                self.handles.append(module.register_forward_hook(self._hook(name)))
        if not self.handles:
            raise InputError("the model has no decoder linear layers to calibrate")

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            # kept where the layer runs (no synchronisation per call); moved to the CPU once
            x, y = args[0].detach(), output.detach()
            ax = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            ay = y.abs().reshape(-1, y.shape[-1]).amax(dim=0).float()
            if name in self.inputs:
                torch.maximum(self.inputs[name], ax, out=self.inputs[name])
                torch.maximum(self.outputs[name], ay, out=self.outputs[name])
            else:
                self.inputs[name], self.outputs[name] = ax, ay

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{n}.input_absmax": t.cpu() for n, t in self.inputs.items()}
        out.update({f"{n}.output_absmax": t.cpu() for n, t in self.outputs.items()})
        return out


def collect(model: torch.nn.Module, ids: torch.Tensor, batch_size: int) -> dict[str, torch.Tensor]:
    """Run `model` over the [samples, seq_len] ids in batches; the statistics by name."""
    recorder = _Recorder(model)
    first = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for row in range(0, ids.shape[0], batch_size):
                model(ids[row : row + batch_size].to(first), use_cache=False)
    finally:
        recorder.close()
    return recorder.tensors()


def _load_model(hf_dir: Path, device: str, offload: Path) -> Any:
    from .verify import load_reference

    if device == "cuda":  # every GPU, spilling to CPU memory and then to disk (accelerate)
        offload.mkdir(parents=True, exist_ok=True)
        return load_reference(hf_dir, dtype="auto", device_map="auto", offload_folder=str(offload))
    return load_reference(hf_dir)


def calibrate(hf_dir: Path, out_dir: Path, options: CalibrationOptions) -> dict[str, Any]:
    """Run the model over the calibration set and write the statistics into `out_dir`."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .verify import pick_device

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    device = pick_device(options.device)
    texts, digest = load_texts(options.dataset)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = make_samples(tokenizer, texts, options)
    model = _load_model(hf_dir, device, out_dir / "offload").eval()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stats = collect(model, ids, options.batch_size)
    save_file({k: v.contiguous() for k, v in sorted(stats.items())}, str(out_dir / "calibration.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    seconds = round(time.perf_counter() - start, 2)
    summary = {
        **asdict(options),
        "device": device,
        "dataset_digest": digest,
        "documents": len(texts),
        "tokens": int(ids.numel()),
        "linears": len(stats) // 2,
        "seconds": seconds,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }
    (out_dir / "calibration.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if (out_dir / "offload").exists():
        import shutil

        shutil.rmtree(out_dir / "offload")
    return summary


def load_stats(directory: Path) -> dict[str, torch.Tensor]:
    """The statistics of a calibration directory, by `<HF linear>.input_absmax` / `.output_absmax`."""
    from safetensors.torch import load_file

    path = directory / "calibration.safetensors"
    if not path.is_file():
        raise InputError(f"{directory} holds no calibration: run trt-builder calibrate")
    return load_file(path)
