"""Fetch: bring a model into a plain HF safetensors directory (config, weights, tokenizer)."""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import shutil
from pathlib import Path
from typing import Any

from .errors import InputError
from .source import ModelSource

#: The tokenizer's files, and the generation config that carries the end ids.
TOKENIZER_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
#: At least one of these: the tokenizer itself.
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "vocab.json")
#: Files kept from a model repo; weights are safetensors unless pickles are explicitly allowed.
KEEP_PATTERNS = ("config.json", *TOKENIZER_FILES, "*.safetensors", "model.safetensors.index.json")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
PICKLE_FIX = (
    "trt-builder loads safetensors only; convert the weights to safetensors, "
    "or pass --allow-pickle to load them with torch.load(weights_only=True)"
)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def check_weight_files(names: list[str], where: str, allow_pickle: bool) -> None:
    """Refuse a model with no safetensors weights, unless pickles are allowed and present."""
    if any(fnmatch.fnmatch(n, "*.safetensors") for n in names):
        return
    pickles = [n for n in names if _matches(n, PICKLE_PATTERNS)]
    if pickles and not allow_pickle:
        raise InputError(f"{where} has only pickle weights ({pickles[0]}, ...): {PICKLE_FIX}")
    if not pickles:
        raise InputError(
            f"{where} has no weights (*.safetensors): pass a model directory or repo with weights"
        )


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise InputError(
            f"{hf_dir} has no config.json: pass a Hugging Face model directory"
        ) from None
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(
            f"{path} is not valid JSON ({exc}): fix or re-download the model"
        ) from None


def check_model_dir(hf_dir: Path) -> None:
    """Refuse a model that needs repository code, or has no tokenizer to verify and serve with."""
    config = read_hf_config(hf_dir)
    if "auto_map" in config or "_attn_implementation_internal" in config:
        raise InputError(
            "config.json asks for custom repository code (auto_map): trt-builder never runs repo code; "
            "use a model whose architecture transformers ships"
        )
    if not any((hf_dir / name).is_file() for name in TOKENIZER_MODELS):
        raise InputError(
            f"the model has no tokenizer ({', '.join(TOKENIZER_MODELS)}): verify and Triton need it; "
            "add the tokenizer files to the model directory"
        )


def model_files(src: Path) -> list[Path]:
    """The top-level files of a local model that fetch reads (weights, pickles, config, tokenizer)."""
    patterns = KEEP_PATTERNS + PICKLE_PATTERNS
    return sorted(p for p in src.iterdir() if p.is_file() and _matches(p.name, patterns))


def pickles_to_safetensors(work: Path) -> list[str]:
    """Rewrite allowed pickle weight files as safetensors (weights_only loading, no code runs)."""
    import torch
    from safetensors.torch import save_file

    converted = []
    for i, path in enumerate(
        sorted(p for p in work.iterdir() if _matches(p.name, PICKLE_PATTERNS))
    ):
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


def fetch_local(src: Path, work: Path, allow_pickle: bool) -> dict[str, Any]:
    names = [p.name for p in model_files(src)]
    check_weight_files(names, str(src), allow_pickle)
    if "config.json" not in names:
        raise InputError(f"{src} has no config.json: pass a Hugging Face model directory")
    patterns = KEEP_PATTERNS + (PICKLE_PATTERNS if allow_pickle else ())
    kept = [n for n in names if _matches(n, patterns)]
    for name in kept:
        # A copy, not a hard link: rewriting the user's file in place must not change hf/.
        shutil.copy2(src / name, work / name)
    check_model_dir(work)
    converted = pickles_to_safetensors(work) if allow_pickle else []
    return {"files": kept, "converted_pickles": converted}


def fetch_hub(repo_id: str, sha: str, work: Path, allow_pickle: bool) -> dict[str, Any]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from .source import _hub_network_errors, hub_offline

    try:
        if hub_offline():
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
                repo_id, revision=sha, allow_patterns=list(patterns), local_files_only=hub_offline()
            )
        )
    except LocalEntryNotFoundError:
        raise InputError(
            f"{repo_id}@{sha[:12]} is not complete in the local HF cache: fetch it once online"
        ) from None
    except _hub_network_errors() as exc:
        raise InputError(
            f"download of {repo_id} failed: {exc}; retry, or set HF_HUB_OFFLINE=1 to use the cache"
        ) from None
    kept = sorted(p.name for p in snap.iterdir() if p.is_file() and _matches(p.name, patterns))
    for name in kept:
        shutil.copyfile((snap / name).resolve(), work / name)  # snapshot entries link to blobs
    check_model_dir(work)
    converted = pickles_to_safetensors(work) if allow_pickle else []
    return {"files": kept, "converted_pickles": converted, "commit": sha}


def fetch_gguf(path: Path, work: Path) -> dict[str, Any]:
    """Dequantize a GGUF file into float32 safetensors with its tokenizer (via transformers)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        # transformers' GGUF reader draws its own tqdm bar; keep it off the user's terminal.
        with contextlib.redirect_stderr(io.StringIO()):
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
    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    (work / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(work)
    tokenizer.save_pretrained(work)
    return {"gguf": path.name, "architecture": type(model).__name__, "tensors": len(state)}


def fetch_model(source: ModelSource, work: Path, *, allow_pickle: bool = False) -> dict[str, Any]:
    """Write the model named by `source` into `work` as an HF safetensors checkpoint."""
    if source.kind == "gguf":
        details = fetch_gguf(Path(source.ref), work)
    elif source.kind == "local":
        details = fetch_local(Path(source.ref), work, allow_pickle)
    else:
        details = fetch_hub(source.ref, source.revision, work, allow_pickle)
    (work / "source.json").write_text(json.dumps(source.to_json(), indent=2, sort_keys=True) + "\n")
    return {"source": source.to_json(), **details}
