from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import edit_json
from trt_builder.core.digests import DigestCache
from trt_builder.core.errors import InputError
from trt_builder.source.fetch import fetch_model
from trt_builder.source.resolve import resolve_source

pytestmark = pytest.mark.integration


def _fetch(model: str, tmp_path: Path, **kw: object) -> tuple[Path, dict]:
    source = resolve_source(model, kw.pop("revision", None), DigestCache(None))  # type: ignore[arg-type]
    work = tmp_path / "hf"
    work.mkdir()
    return work, fetch_model(source, work, **kw)  # type: ignore[arg-type]


def test_local_directory_keeps_weights_config_and_tokenizer(
    tiny_copy: Path, tmp_path: Path
) -> None:
    (tiny_copy / "README.md").write_text("not needed")
    work, details = _fetch(str(tiny_copy), tmp_path)
    assert sorted(os.listdir(work)) == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "source.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]  # fmt: skip
    )
    source = json.loads((work / "source.json").read_text())
    assert source["kind"] == "local" and source["revision"].startswith("sha256-")
    assert details["converted_pickles"] == []


def test_content_revision_changes_with_content(tiny_copy: Path) -> None:
    before = resolve_source(str(tiny_copy), None, DigestCache(None)).revision
    edit_json(tiny_copy / "config.json", rms_norm_eps=1e-6)
    assert resolve_source(str(tiny_copy), None, DigestCache(None)).revision != before


def _pickle_only(model_dir: Path) -> None:
    weights = load_file(model_dir / "model.safetensors")
    torch.save(weights, model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()


def test_pickle_only_is_refused_with_the_fix(tiny_copy: Path, tmp_path: Path) -> None:
    _pickle_only(tiny_copy)
    with pytest.raises(
        InputError, match=r"only pickle weights \(pytorch_model.bin, \.\.\.\).*--allow-pickle"
    ):
        _fetch(str(tiny_copy), tmp_path)


def test_allow_pickle_rewrites_as_safetensors(tiny_copy: Path, tmp_path: Path) -> None:
    expected = load_file(tiny_copy / "model.safetensors")
    _pickle_only(tiny_copy)
    work, details = _fetch(str(tiny_copy), tmp_path, allow_pickle=True)
    assert details["converted_pickles"] == ["pytorch_model.bin"]
    assert not list(work.glob("*.bin"))
    got = load_file(next(work.glob("*.safetensors")))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_pickle_with_code_is_not_executed(tiny_copy: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary"

    class Payload:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {canary}",))

    (tiny_copy / "model.safetensors").unlink()
    torch.save({"x": Payload()}, tiny_copy / "pytorch_model.bin")
    with pytest.raises(InputError, match="not a weights-only pickle"):
        _fetch(str(tiny_copy), tmp_path, allow_pickle=True)
    assert not canary.exists()


def test_remote_code_config_is_refused(tiny_copy: Path, tmp_path: Path) -> None:
    edit_json(tiny_copy / "config.json", auto_map={"AutoModelForCausalLM": "modeling.Evil"})
    with pytest.raises(InputError, match="never runs repo code"):
        _fetch(str(tiny_copy), tmp_path)


def _hub_cache(tiny: Path, sha: str) -> None:
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / "models--org--tiny"
    snap = root / "snapshots" / sha
    shutil.rmtree(root, ignore_errors=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)
    for item in tiny.iterdir():
        shutil.copy2(item, snap / item.name)


def test_hub_repo_offline_from_the_local_cache(tiny_llama: Path, tmp_path: Path) -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(tiny_llama, sha)
    source = resolve_source("org/tiny", "main", DigestCache(None))
    assert source.kind == "hub" and source.revision == sha  # the branch is pinned to its commit
    work, details = _fetch("org/tiny", tmp_path, revision="main")
    assert details["commit"] == sha and (work / "model.safetensors").is_file()
    with pytest.raises(InputError, match="not in the local HF cache and HF_HUB_OFFLINE is set"):
        resolve_source("org/tiny", "v2", DigestCache(None))


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("/no/such/model.gguf", "does not exist: check the --model path"),
        ("not a repo id!", "is not an existing directory, a .gguf file or a hub repo id"),
    ],
)
def test_bad_model_arguments(model: str, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        resolve_source(model, None, DigestCache(None))


def test_revision_ignores_files_fetch_does_not_read(tiny_copy: Path) -> None:
    before = resolve_source(str(tiny_copy), None, DigestCache(None)).revision
    (tiny_copy / "README.md").write_text("notes")
    (tiny_copy / ".git").mkdir()
    (tiny_copy / ".git" / "HEAD").write_text("ref: main")
    assert resolve_source(str(tiny_copy), None, DigestCache(None)).revision == before


def test_fetched_files_are_copies_not_links(tiny_copy: Path, tmp_path: Path) -> None:
    work, _ = _fetch(str(tiny_copy), tmp_path)
    assert (work / "model.safetensors").stat().st_ino != (
        tiny_copy / "model.safetensors"
    ).stat().st_ino


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("tokenizer", "the model has no tokenizer (tokenizer.json, tokenizer.model, vocab.json)"),
        ("config", "config.json is not valid JSON"),
    ],
)
def test_broken_model_directories_are_refused(
    tiny_copy: Path, tmp_path: Path, damage: str, needle: str
) -> None:
    if damage == "tokenizer":
        (tiny_copy / "tokenizer.json").unlink()
    else:
        (tiny_copy / "config.json").write_text("{not json")
    with pytest.raises(InputError) as info:
        _fetch(str(tiny_copy), tmp_path)
    assert needle in str(info.value)


def test_hub_network_failure_is_a_one_line_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import HfApi, errors

    def unreachable(*args: object, **kwargs: object) -> None:
        raise getattr(errors, "HTTPError", OSError)("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(HfApi, "model_info", unreachable)
    with pytest.raises(
        InputError, match="cannot reach the hub for org/tiny .* set HF_HUB_OFFLINE=1"
    ):
        resolve_source("org/tiny", "main", DigestCache(None))


def test_hub_model_is_refused_from_its_config_before_the_weights(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Only config.json is in the cache: an unsupported architecture is refused without needing
    the weights (which are not there)."""
    from huggingface_hub import constants

    from trt_builder.core.errors import UnsupportedModelError
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    sha = "fedcba9876543210fedcba9876543210fedcba98"
    root = Path(constants.HF_HUB_CACHE) / "models--org--mamba"
    shutil.rmtree(root, ignore_errors=True)
    (root / "snapshots" / sha).mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)
    config = json.loads((tiny_llama / "config.json").read_text())
    (root / "snapshots" / sha / "config.json").write_text(
        json.dumps({**config, "architectures": ["MambaForCausalLM"]})
    )
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM is not supported"):
        run(make_spec(model="org/mamba", out=tmp_path / "e", triton_root=tmp_path / "t"))
    assert not (tmp_path / "e").exists()


def test_a_local_model_is_read_once_for_its_digests(tiny_llama: Path, tmp_path: Path) -> None:
    """Fetching a local directory hashes the source once (its content revision); the copies
    take the source's digests, and the stage's record reads no byte of hf/ again. The digests
    remembered are the copies' own."""
    from trt_builder.core.digests import DigestCache, sha256_file
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec

    size = sum(p.stat().st_size for p in tiny_llama.iterdir() if p.is_file())
    result = run(make_spec(model=str(tiny_llama), out=tmp_path / "e", triton_root=tmp_path / "t"),
                 only=("fetch",))  # fmt: skip
    assert result.records[0].status == "ran"
    assert size <= result.hashed_bytes < 1.2 * size  # a second read would make it 2x
    memo = DigestCache(tmp_path / "e" / ".trt-builder" / "digests.json")
    copies = [p for p in Path(result.layout.hf).iterdir() if p.name != "stage.json"]
    assert {p.name for p in copies} >= {"config.json", "model.safetensors"}
    assert all(memo.known(p) == sha256_file(p) for p in copies)


def test_a_first_build_imports_torch_while_fetch_runs(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head start on torch and transformers is taken on a first build from a directory only
    (fetch runs, torch stages follow), and never outlives the run; fetch alone, a rerun, or a
    fetch that imports torch itself (pickles) takes none."""
    import threading

    from trt_builder.pipeline import build
    from trt_builder.spec.build import make_spec

    started: list[str] = []
    monkeypatch.setattr(
        build, "_import_torch", lambda: started.append(threading.current_thread().name)
    )
    spec = make_spec(model=str(tiny_llama), out=tmp_path / "e", triton_root=tmp_path / "t")
    build.run(spec, only=("fetch",))
    assert started == []
    build.run(spec, only=("fetch", "convert"))  # fetch cached: convert imports torch itself
    pickles = make_spec(model=str(tiny_llama), out=tmp_path / "e3", triton_root=tmp_path / "t",
                        allow_pickle=True)  # fmt: skip
    build.run(pickles, only=("fetch", "convert"))
    assert started == []
    other = make_spec(model=str(tiny_llama), out=tmp_path / "e2", triton_root=tmp_path / "t")
    build.run(other, only=("fetch", "convert"))
    assert started == ["warm-imports"]
    assert not any(t.name == "warm-imports" for t in threading.enumerate())
