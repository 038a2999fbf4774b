from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trt_builder.errors import PackageError
from trt_builder.triton.repository import RepositoryOptions, validate_repository, write_repository

OPTS = RepositoryOptions(
    max_batch_size=4,
    max_input_len=64,
    max_beam_width=1,
    engine_path="/models/x/tensorrt_llm/1/engine",
)


@pytest.fixture
def repo(tmp_path: Path, tokenizer_dir: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    write_repository(root, OPTS, sorted(tokenizer_dir.iterdir()), None)
    return root


def test_every_config_parses_with_tritons_schema(repo: Path) -> None:
    names = sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))
    assert names == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    for name in names:
        config = mc.ModelConfig()
        text_format.Parse((repo / name / "config.pbtxt").read_text(), config)
        assert config.name == name and config.max_batch_size == 4
    llm = validate_repository(repo)["tensorrt_llm"]
    assert llm.backend == "tensorrtllm"
    assert llm.parameters["gpt_model_path"].string_value == OPTS.engine_path
    assert llm.parameters["gpt_model_type"].string_value == "inflight_fused_batching"
    assert (repo / "preprocessing" / "1" / "model.py").is_file()
    assert (repo / "preprocessing" / "tokenizer" / "tokenizer.json").is_file()


def _edit(repo: Path, model: str, old: str, new: str) -> None:
    path = repo / model / "config.pbtxt"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("model", "old", "new", "needle"),
    [
        (
            "ensemble",
            'model_name: "postprocessing"',
            'model_name: "postprocess"',
            "step model 'postprocess' is not in the repository",
        ),
        ("ensemble", 'key: "QUERY"', 'key: "PROMPT"', "preprocessing has no input 'PROMPT'"),
        (
            "ensemble",
            'value: "_TOKENS_BATCH"\n    }\n    output_map',
            'value: "_TOKENS"\n    }\n    output_map',
            "tensor '_TOKENS_BATCH' feeding postprocessing.TOKENS_BATCH is produced by no earlier step",
        ),
        (
            "tensorrt_llm",
            'name: "input_lengths"\n  data_type: TYPE_INT32',
            'name: "input_lengths"\n  data_type: TYPE_INT64',
            "'_REQUEST_INPUT_LEN' is TYPE_INT32 but tensorrt_llm.input_lengths takes TYPE_INT64",
        ),
        (
            "tensorrt_llm",
            "max_batch_size: 4",
            "max_batch_size: four",
            "tensorrt_llm/config.pbtxt does not parse as Triton's ModelConfig",
        ),
        (
            "preprocessing",
            'name: "preprocessing"',
            'name: "pre"',
            "model preprocessing: config.pbtxt says name 'pre'",
        ),
    ],
)
def test_wiring_errors_are_named(repo: Path, model: str, old: str, new: str, needle: str) -> None:
    _edit(repo, model, old, new)
    with pytest.raises(PackageError) as info:
        validate_repository(repo)
    assert needle in str(info.value)


def test_missing_model_py(repo: Path) -> None:
    (repo / "postprocessing" / "1" / "model.py").unlink()
    with pytest.raises(PackageError, match="postprocessing: python backend without 1/model.py"):
        validate_repository(repo)


def test_unmapped_required_input(repo: Path) -> None:
    _edit(
        repo,
        "ensemble",
        'input_map {\n      key: "input_lengths"\n      value: "_REQUEST_INPUT_LEN"\n    }\n',
        "",
    )
    with pytest.raises(
        PackageError, match="required input 'input_lengths' of tensorrt_llm is not mapped"
    ):
        validate_repository(repo)


def _module(repo: Path, name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, repo / name / "1" / "model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_models_tokenize_like_the_hf_tokenizer(repo: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo / "preprocessing" / "tokenizer")
    pre = _module(repo, "preprocessing")
    text = "The quick brown fox — naïve café 1, 2, 3"
    assert pre.encode_query(tok, text, add_special_tokens=True, max_input_len=64) == tok.encode(
        text
    )
    with pytest.raises(ValueError, match="empty prompt"):
        pre.encode_query(tok, "   ", add_special_tokens=True, max_input_len=64)
    with pytest.raises(ValueError, match="the engine accepts at most 64"):
        pre.encode_query(tok, "fox " * 200, add_special_tokens=True, max_input_len=64)
    words = pre.words_to_ids(tok, ["fox", "lazy dog"])
    flat = tok.encode("fox", add_special_tokens=False) + tok.encode(
        "lazy dog", add_special_tokens=False
    )
    assert words.shape == (2, len(flat)) and words[0].tolist() == flat
    assert words[1, 1] == len(flat) and words[1, 2:].tolist() == [-1] * (len(flat) - 2)

    post = _module(repo, "postprocessing")
    ids = tok.encode("Photosynthesis is the process")
    tokens = np.array([ids + [0, 0]], dtype=np.int32)
    assert post.decode_batch(tok, tokens, np.array([len(ids)]), skip_special_tokens=True) == [
        "Photosynthesis is the process"
    ]


@pytest.mark.triton
def test_live_server_answers(tmp_path: Path) -> None:
    """Against a deployment of a trt-builder repository: TRITON_URL=host:8000."""
    import tritonclient.http as http

    client = http.InferenceServerClient(os.environ["TRITON_URL"])
    assert client.is_server_ready() and client.is_model_ready("ensemble")
    text = http.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([["The capital of France is"]], dtype=object))
    length = http.InferInput("max_tokens", [1, 1], "INT32")
    length.set_data_from_numpy(np.array([[8]], dtype=np.int32))
    out = client.infer("ensemble", [text, length]).as_numpy("text_output")
    assert out is not None and out.reshape(-1)[0].decode().strip()


def test_preprocessing_handles_a_batch_and_the_generation_config_end_id(
    repo: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo / "preprocessing" / "tokenizer")
    pre = _module(repo, "preprocessing")
    texts = ["The quick brown fox", "Photosynthesis is"]
    inputs = {
        "QUERY": np.array([[t.encode()] for t in texts], dtype=object),
        "REQUEST_OUTPUT_LEN": np.array([[8], [4]], dtype=np.int32),
        "END_ID": np.array([[7], [9]], dtype=np.int32),
        "STOP_WORDS_DICT": np.array([[b"fox"], [b""]], dtype=object),
    }
    out = pre.preprocess(tok, inputs, add_special_tokens=True, max_input_len=64, end_id=2, pad_id=0)
    ids = [tok.encode(t) for t in texts]
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(ids[0])], [len(ids[1])]]
    assert out["INPUT_ID"][0, : len(ids[0])].tolist() == ids[0]
    assert out["INPUT_ID"][1, : len(ids[1])].tolist() == ids[1]
    assert out["OUT_END_ID"].tolist() == [[7], [9]] and out["OUT_PAD_ID"].tolist() == [[0], [0]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[8], [4]]
    assert out["STOP_WORDS_IDS"].shape[:2] == (2, 2)
    fox = tok.encode("fox", add_special_tokens=False)
    assert out["STOP_WORDS_IDS"][0, 0, : len(fox)].tolist() == fox
    assert out["STOP_WORDS_IDS"][1, 1, 0] == -1  # no stop words in row 2

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 2]}')
    assert pre.default_end_id(tok, tmp_path) == 5
    assert pre.default_end_id(tok, tmp_path / "none") == tok.eos_token_id
