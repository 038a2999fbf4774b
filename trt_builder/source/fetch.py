"""Fetch: bring a model into a plain HF safetensors directory (config, weights, tokenizer)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..core.digests import DigestCache, copy_hashed
from ..core.errors import InputError
from .files import (
    KEEP_PATTERNS,
    PICKLE_PATTERNS,
    check_model_dir,
    check_weight_files,
    matches,
    model_files,
    read_hf_config,
)
from .hub import config_dir, hub_offline, network_errors
from .resolve import ModelSource


def pickles_to_safetensors(work: Path) -> list[str]:
    """Rewrite allowed pickle weight files as safetensors (weights_only loading, no code runs)."""
    import torch
    from safetensors.torch import save_file

    converted = []
    for i, path in enumerate(sorted(p for p in work.iterdir() if matches(p.name, PICKLE_PATTERNS))):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise InputError(
                f"{path.name} could not be loaded as plain weights ({exc}): it is not a weights-only pickle"
            ) from None
        state = {k: v.detach().clone().contiguous() for k, v in state.items()}
        save_file(state, str(work / f"model-pickle-{i:05d}.safetensors"), metadata={"format": "pt"})
        path.unlink()
        converted.append(path.name)
    return converted


def fetch_local(
    src: Path, work: Path, allow_pickle: bool, digests: DigestCache | None = None
) -> dict[str, Any]:
    names = [p.name for p in model_files(src)]
    check_weight_files(names, str(src), allow_pickle)
    if "config.json" not in names:
        raise InputError(f"{src} has no config.json: pass a Hugging Face model directory")
    patterns = KEEP_PATTERNS + (PICKLE_PATTERNS if allow_pickle else ())
    kept = [n for n in names if matches(n, patterns)]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="fetch") as pool:
        list(pool.map(lambda name: _copy(src / name, work / name, digests), kept))
    check_model_dir(work)
    converted = pickles_to_safetensors(work) if allow_pickle else []
    return {"files": kept, "converted_pickles": converted}


def _copy(src: Path, dst: Path, digests: DigestCache | None) -> None:
    """A copy, not a hard link: rewriting the user's file in place must not change hf/. Its
    digest goes to the memo, so that the stage's record does not read it again: the source's,
    when resolving the model's revision has just hashed it and it did not change during the
    copy (the kernel copies it, no byte passes through Python); else hashed as it is copied."""
    known = None if digests is None else digests.known(src)
    if known is not None:
        shutil.copyfile(src, dst)
        shutil.copystat(src, dst)
        if digests is not None and digests.known(src) == known:
            digests.remember(dst, known)
        return
    digest = copy_hashed(src, dst)
    if digests is not None:
        digests.remember(dst, digest)


def fetch_hub(
    repo_id: str, sha: str, work: Path, allow_pickle: bool, offline: bool | None = None
) -> dict[str, Any]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        if hub_offline(offline):
            listing = Path(snapshot_download(repo_id, revision=sha, local_files_only=True))
            names = sorted(p.name for p in listing.iterdir())
        else:
            from huggingface_hub import HfApi

            names = sorted(
                s.rfilename
                for s in HfApi().model_info(repo_id, revision=sha, files_metadata=False).siblings
                or []
            )
        check_weight_files(
            [n for n in names if "/" not in n], f"{repo_id}@{sha[:12]}", allow_pickle
        )
        patterns = KEEP_PATTERNS + (PICKLE_PATTERNS if allow_pickle else ())
        snap = Path(
            snapshot_download(
                repo_id,
                revision=sha,
                allow_patterns=list(patterns),
                local_files_only=hub_offline(offline),
            )
        )
    except LocalEntryNotFoundError:
        raise InputError(
            f"{repo_id}@{sha[:12]} is not complete in the local HF cache: fetch it once online"
        ) from None
    except network_errors() as exc:
        raise InputError(
            f"download of {repo_id} failed: {exc}; retry, or set HF_HUB_OFFLINE=1 to use the cache"
        ) from None
    kept = sorted(p.name for p in snap.iterdir() if p.is_file() and matches(p.name, patterns))
    for name in kept:
        shutil.copyfile((snap / name).resolve(), work / name)  # snapshot entries link to blobs
    check_model_dir(work)
    converted = pickles_to_safetensors(work) if allow_pickle else []
    return {"files": kept, "converted_pickles": converted, "commit": sha}


def _plain_config(config: Any, architecture: str) -> dict[str, Any]:
    """The config.json fetch writes for a GGUF model: transformers' config, less the GGUF
    quantization and the file's own path, with its architecture named."""
    cfg = dict(config.to_dict())
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = [architecture]
    return cfg


def gguf_config(path: Path) -> dict[str, Any]:
    """A GGUF model's config.json as fetch writes it, from the file's metadata alone (no
    tensor is dequantized): for the memory plan before fetch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (ValueError, OSError, KeyError) as exc:
        raise InputError(f"{path.name} could not be read as a GGUF model ({exc})") from None
    return _plain_config(config, str(getattr(model_class, "__name__", "")))


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers parses the GGUF file once for the config, once for the tokenizer and twice
    for the weights (`load_gguf_checkpoint`), and builds gguf's tensor-name map once per module
    (397 times for SmolLM2): about 18 s of a 27 s fetch on 2 cores. Within this block each is
    made once: `gguf.GGUFReader` per path (a read-only memory map) and `get_tensor_name_map` per
    (architecture, layers)."""
    import functools

    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def read(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = str(path)
        if args or kwargs:  # not the call transformers makes: no memo
            return reader(path, *args, **kwargs)
        if key not in readers:
            readers[key] = reader(path)
        return readers[key]

    gguf.GGUFReader = read  # type: ignore[misc, assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader = reader  # type: ignore[misc]
        gguf.get_tensor_name_map = name_map


def fetch_gguf(path: Path, work: Path) -> dict[str, Any]:
    """Dequantize a GGUF file into float32 safetensors with its tokenizer (via transformers)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        # transformers' GGUF reader draws its own tqdm bar; keep it off the user's terminal.
        with contextlib.redirect_stderr(io.StringIO()), _one_gguf_parse():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
    except (ValueError, OSError, KeyError) as exc:
        raise InputError(f"{path.name} could not be read as a GGUF model ({exc})") from None
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
    cfg = _plain_config(config, type(model).__name__)
    (work / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(work)
    tokenizer.save_pretrained(work)
    return {"gguf": path.name, "architecture": type(model).__name__, "tensors": len(state)}


def fetch_model(
    source: ModelSource,
    work: Path,
    *,
    allow_pickle: bool = False,
    offline: bool | None = None,
    digests: DigestCache | None = None,
) -> dict[str, Any]:
    """Write the model named by `source` into `work` as an HF safetensors checkpoint."""
    if source.kind == "gguf":
        details = fetch_gguf(Path(source.ref), work)
    elif source.kind == "local":
        details = fetch_local(Path(source.ref), work, allow_pickle, digests)
    else:
        details = fetch_hub(source.ref, source.revision, work, allow_pickle, offline)
    (work / "source.json").write_text(json.dumps(source.to_json(), indent=2, sort_keys=True) + "\n")
    return {"source": source.to_json(), **details}


def config_alone(
    kind: str, ref: str, sha: str | None, *, offline: bool | None = None
) -> dict[str, Any]:
    """A model's config.json without its weights: a local directory's, a hub model's at `sha`
    (downloaded by itself), a GGUF file's (from its metadata, as fetch would write it)."""
    if kind == "local":
        return read_hf_config(Path(ref))
    if kind == "hub":
        assert sha is not None
        return read_hf_config(config_dir(ref, sha, offline=offline))
    return gguf_config(Path(ref))
