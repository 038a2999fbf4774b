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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked trtllm / triton / gpu run only where that exists."""
    have = {
        "trtllm": shutil.which("trtllm-build") is not None and _importable("tensorrt_llm"),
        "triton": bool(os.environ.get("TRITON_URL")),
        "gpu": _cuda(),
    }
    reasons = {
        "trtllm": "needs TensorRT-LLM and trtllm-build (an NVIDIA GPU host)",
        "triton": "needs a live Triton server: set TRITON_URL",
        "gpu": "needs a CUDA GPU",
    }
    for item in items:
        for marker, present in have.items():
            if marker in item.keywords and not present:
                item.add_marker(pytest.mark.skip(reason=reasons[marker]))


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
    proc = subprocess.run(
        [exe, "build", "--dtype", "int8", "--json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
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
def smollm2_hf(default_build: tuple[Path, dict[str, Any]]) -> Path:
    """SmolLM2-135M-Instruct as fetch wrote it (safetensors, tokenizer, configs)."""
    cwd, result = default_build
    return cwd / "engines" / "SmolLM2-135M-Instruct" / result["revision"] / "hf"
