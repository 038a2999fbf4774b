"""Shared fixtures: isolated caches, tiny random Llama models with a real trained tokenizer."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Before anything imports huggingface_hub (it reads these once): a private cache, no network.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="trt-builder-hf-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)
os.environ["HF_HUB_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from tiny_models import make_tiny_llama, make_tokenizer  # noqa: E402
from trt_builder.core.allocator import reuse_freed_memory  # noqa: E402

reuse_freed_memory()  # the tests that compute in this process, as the pipeline's stages do


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked trtllm / triton / gpu run only where that exists."""
    have = {
        "trtllm": shutil.which("trtllm-build") is not None and _importable("tensorrt_llm"),
        "triton": _tritonserver(),
        "gpu": _cuda(),
    }
    reasons = {
        "trtllm": "needs TensorRT-LLM and trtllm-build (an NVIDIA GPU host)",
        "triton": "needs tritonserver (pip install 'trt-builder[serve]')",
        "gpu": "needs a CUDA GPU",
    }
    for item in items:
        for marker, present in have.items():
            if marker in item.keywords and not present:
                item.add_marker(pytest.mark.skip(reason=reasons[marker]))


def _tritonserver() -> bool:
    from trt_builder.triton.server import find_tritonserver

    return find_tritonserver() is not None


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep the hub offline, run in a temporary directory, and use no stand-in trtllm-build."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRT_BUILDER_TRTLLM_BUILD", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A 2-layer GQA Llama (hidden 64) in float32 safetensors, with tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path, tokenizer_dir)
    return path


@pytest.fixture
def tiny_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model that a test may edit."""
    dst = tmp_path / "tiny-llama"
    shutil.copytree(tiny_llama, dst)
    return dst


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def build_default(cwd: Path) -> dict[str, Any]:
    exe = shutil.which("trt-builder") or str(Path(sys.executable).with_name("trt-builder"))
    # No timeout of its own: on a busy 2-core host the build takes minutes more than usual, and
    # a fixture that gives up takes every test that uses it down with it. A hang is bounded by
    # the CI job's limit, and pytest's own output names the test that was running.
    proc = subprocess.run(
        [exe, "build", "--dtype", "int8", "--json"], cwd=cwd, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="session")
def default_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The README's main job, `trt-builder build --dtype int8`, run once in a fresh directory
    on the embedded SmolLM2-135M-Instruct: (that directory, the --json result)."""
    cwd = tmp_path_factory.mktemp("user")
    return cwd, build_default(cwd)


@pytest.fixture(scope="session")
def default_variant(
    default_build: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """Builds a variant of the default model in the default build's directory, in this process:
    `build(**spec)` -> the pipeline's result, packaged into a Triton root of its own. The stages
    are keyed as the pipeline keys them, so whatever the mode matrix (tests/test_modes.py, the
    CLI in the same directory) or an earlier test built with the same inputs is taken from the
    cache, and what is built here is there for them: give a row's own settings (no smaller
    held-out set, no search left out) to share its build."""
    from trt_builder.pipeline import run
    from trt_builder.spec.build import make_spec

    cwd, _ = default_build

    def build(**spec: Any) -> Any:
        root = tmp_path_factory.mktemp("default-variant")
        return run(make_spec(out=cwd / "engines", triton_root=root / "triton", **spec))

    return build


@pytest.fixture(scope="session")
def smollm2_hf(default_build: tuple[Path, dict[str, Any]]) -> Path:
    """SmolLM2-135M-Instruct as fetch wrote it (safetensors, tokenizer, configs)."""
    cwd, result = default_build
    return cwd / "engines" / "SmolLM2-135M-Instruct" / result["revision"] / "hf"


#: Config fields where we differ from modelopt 0.47 on purpose (docs/design.md): logits in
#: float32 (the engine's logits_dtype), TensorRT-LLM's default use_parallel_embedding false,
#: and our fuller mapping and quantization tables (compared key by key below).
DELIBERATE = {"logits_dtype", "use_parallel_embedding", "mapping", "quantization"}
#: modelopt writes GPT-2 as a rope model with exact GELU; GPT-2 has learned positions and
#: the tanh GELU (TensorRT-LLM's own GPT-2 converter writes what we write).
MODELOPT_GPT2 = {"position_embedding_type": "rope_gpt_neox", "hidden_act": "gelu"}


def compare_with_modelopt_config(ours: dict[str, Any], theirs: dict[str, Any], family: str) -> None:
    """Every field both write agrees, but the deliberate differences; the model-defining
    fields are there in both."""
    for key in ("architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_size", "intermediate_size",
                "norm_epsilon", "max_position_embeddings", "hidden_act"):  # fmt: skip
        assert key in ours and key in theirs, key
    known = MODELOPT_GPT2 if family == "gpt2" else {}
    for key, value in known.items():
        assert theirs[key] == value and ours[key] != value, key
    for key in sorted(set(ours) & set(theirs) - DELIBERATE - set(known)):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    for key in ("world_size", "tp_size", "pp_size"):
        assert ours["mapping"][key] == theirs["mapping"][key], key
    for key in ("quant_algo", "kv_cache_quant_algo"):
        assert ours["quantization"][key] == theirs["quantization"][key], key
