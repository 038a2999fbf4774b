"""The model one decoder layer at a time, with memory that does not grow with depth.

The transformers model is loaded with its decoder layers left in the model's own safetensors
files (accelerate's disk offload, which transformers points at the weight files themselves:
nothing is copied), and with the lm_head and any vision tower left there too; what runs before
the first layer (the embeddings, the rotary tables) is on the device. The tokens' hidden states
at the first layer's input are taken from the model's own forward, with the arguments it gives
its layers; then each layer's weights are read onto the device, every batch of states goes
through it, and its weights are released before the next is read. Each layer is the model's
own module called with the model's own arguments, batch by batch, so it computes exactly what
it computes inside the whole model (tests/test_calibrate.py: the statistics bit for bit).

The carried states stay on the device (one batch's activations for each batch of tokens:
samples x sequence x hidden). accelerate's hooks are what transformers installs for offloaded
modules; this module takes the weights from them once per layer and calls the layer without
them, instead of reading every weight again for every batch.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.family import Family
from ..source.hf import load_hf_model, model_class


class _Caught(Exception):
    """Raised by the first layer's pre-hook: its inputs are taken, nothing after it runs."""


@dataclass
class Carried:
    """One batch of tokens at a layer's input: its hidden states, and the other arguments the
    model's forward gives every layer (rotary tables, masks, positions)."""

    states: torch.Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _placement(model: Any, family: Family, device: str) -> tuple[dict[str, Any], list[str]]:
    """(transformers' device_map: each decoder layer, the lm_head where it is not the embedding
    and the vision tower on "disk", the rest on `device`; the layers' module paths in order)."""
    where: Any = 0 if device == "cuda" else device
    layer = re.compile(family.decoder_layer)
    head = model.get_output_embeddings()
    untied = head is not None and head.weight is not model.get_input_embeddings().weight
    away = [name for name, module in model.named_modules() if untied and module is head]
    layers: list[str] = []
    placement: dict[str, Any] = {}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, _ in tensors:
        found = layer.search(name)
        if found:
            prefix = name[: found.end() - 1]
            if prefix not in placement:
                layers.append(prefix)
            placement[prefix] = "disk"
        elif name.startswith(family.vision_tower) or any(name.startswith(f"{a}.") for a in away):
            placement[name.rsplit(".", 1)[0]] = "disk"
        else:
            placement[name.rsplit(".", 1)[0]] = where
    return placement, layers


class LayerByLayer:
    """The model of `hf_dir` in `dtype` ("auto": as stored) with its decoder layers on disk,
    run one layer at a time on `device` (`run`)."""

    def __init__(self, hf_dir: Path, device: str, dtype: torch.dtype | str, family: Family
                 ) -> None:  # fmt: skip
        from accelerate import init_empty_weights
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(hf_dir)
        with init_empty_weights():
            skeleton = model_class(config).from_config(config)
        placement, self.layer_names = _placement(skeleton, family, device)
        del skeleton
        self.device = device
        self._offload = tempfile.TemporaryDirectory(prefix="trt-builder-offload-")
        # accelerate warns "Some parameters are on the meta device": as meant here
        said = logging.getLogger("accelerate.big_modeling")
        level = said.level
        said.setLevel(logging.ERROR)
        try:
            self.model = load_hf_model(hf_dir, dtype=dtype, device_map=placement,
                                       offload_folder=self._offload.name).eval()  # fmt: skip
        finally:
            said.setLevel(level)

    def close(self) -> None:
        self._offload.cleanup()

    def __enter__(self) -> LayerByLayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, ids: torch.Tensor, batch_size: int) -> list[Carried]:
        """The hidden states (and the layers' other arguments) of `ids` [samples, seq_len] at
        the first layer's input, `batch_size` samples at a time."""
        first = self.model.get_submodule(self.layer_names[0])
        carried: list[Carried] = []

        def catch(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            carried.append(Carried(args[0], args[1:], kwargs))
            raise _Caught

        handle = first.register_forward_pre_hook(catch, with_kwargs=True)
        try:
            with torch.inference_mode():
                for row in range(0, ids.shape[0], batch_size):
                    try:
                        self.model(ids[row : row + batch_size].to(self.device), use_cache=False)
                    except _Caught:
                        pass
        finally:
            handle.remove()
        return carried

    def run(self, carried: list[Carried]) -> list[Carried]:
        """Every batch through every layer, one layer's weights on the device at a time (the
        forward hooks on its modules see each batch, as in the whole model); the states after
        the last layer."""
        with torch.inference_mode():
            for name in self.layer_names:
                with self.loaded(name) as layer:
                    for batch in carried:
                        out = layer(batch.states, *batch.args, **batch.kwargs)
                        batch.states = out[0] if isinstance(out, tuple) else out
        return carried

    @contextmanager
    def loaded(self, name: str) -> Iterator[Any]:
        """The layer `name` with its weights read onto the device (once, not per call), put back
        on the meta device after."""
        from accelerate.hooks import remove_hook_from_module
        from accelerate.utils import set_module_tensor_to_device

        layer = self.model.get_submodule(name)
        weights: dict[str, torch.Tensor] = {}
        for path, module in layer.named_modules():
            hook = getattr(module, "_hf_hook", None)  # accelerate's, on each offloaded module
            if hook is not None and hook.weights_map is not None:
                for tensor, _ in module.named_parameters(recurse=False):
                    weights[f"{path}.{tensor}" if path else tensor] = hook.weights_map[tensor]
        remove_hook_from_module(layer, recurse=True)
        for tensor, value in weights.items():
            set_module_tensor_to_device(layer, tensor, self.device, value=value)
        del weights
        try:
            yield layer
        finally:
            for tensor, _ in list(layer.named_parameters()):
                set_module_tensor_to_device(layer, tensor, "meta")
