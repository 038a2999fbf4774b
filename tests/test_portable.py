"""The Hugging Face files trt-builder ships (the Triton repository's tokenizer, the llmapi
checkpoint) read the same with transformers 4.57.1, which TensorRT-LLM 1.2 pins and its NGC
containers run, as with this host's transformers 5 (source/portable.py). scripts/setup.sh
installs 4.57.1 in .venv/transformers4; the probe runs it in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import edit_json
from trt_builder.source.portable import copy_portable

pytestmark = pytest.mark.integration
TRANSFORMERS4 = Path(sys.prefix) / "transformers4"
TEXT = "def main():\n    return 42  # the answer"
PROBE = """
import json, sys, transformers
from transformers import AutoConfig, AutoTokenizer
out = {"version": transformers.__version__}
config = AutoConfig.from_pretrained(sys.argv[1])
out["rope_theta"] = getattr(config, "rope_theta", None)
out["dtype"] = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None))
try:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    out["ids"] = tok(sys.argv[2]).input_ids
    out["chat"] = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
    out["eos"] = tok.eos_token_id
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _probe(directory: Path, transformers4: bool) -> dict[str, object]:
    env = dict(os.environ)
    if transformers4:
        assert (TRANSFORMERS4 / "transformers").is_dir(), "run scripts/setup.sh"
        env["PYTHONPATH"] = str(TRANSFORMERS4)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(directory), TEXT], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def saved_by_5(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's config and tokenizer as transformers 5 saved them, RoPE base 100000
    (SmolLM2's) in rope_parameters only, as the default model's fetch writes it."""
    out = tmp_path_factory.mktemp("saved-by-5")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_llama / name).is_file():
            (out / name).write_bytes((tiny_llama / name).read_bytes())
    edit_json(out / "config.json", rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    config = json.loads((out / "config.json").read_text())
    assert "rope_theta" not in config and "torch_dtype" not in config
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "TokenizersBackend"
    )
    return out


def test_transformers_4_misreads_what_5_saves(saved_by_5: Path) -> None:
    """Why the rewrite exists: 4.57 runs the RoPE at its default base and cannot load the
    tokenizer at all."""
    old = _probe(saved_by_5, transformers4=True)
    assert old["version"] == "4.57.1"
    assert old["rope_theta"] == 10000.0
    assert "TokenizersBackend does not exist" in str(old.get("error"))


def test_portable_files_read_alike_in_4_and_5(saved_by_5: Path, tmp_path: Path) -> None:
    for path in saved_by_5.iterdir():
        copy_portable(path, tmp_path / path.name)
    old, new = _probe(tmp_path, transformers4=True), _probe(tmp_path, transformers4=False)
    assert old["version"] == "4.57.1" and str(new["version"]).startswith("5.")
    assert "error" not in old and "error" not in new, (old.get("error"), new.get("error"))
    assert old["rope_theta"] == 100000.0
    assert old["ids"] == new["ids"] and len(old["ids"]) > 5  # type: ignore[arg-type]
    assert old["chat"] == new["chat"] and "hi" in str(new["chat"])
    assert old["eos"] == new["eos"] == 2
    assert old["dtype"].endswith("float32") and new["dtype"].endswith("float32")  # type: ignore[union-attr]
    # transformers 5 reads what it wrote the same way: the same ids from the original files
    assert _probe(saved_by_5, transformers4=False)["ids"] == new["ids"]
