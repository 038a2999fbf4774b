from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trt_builder.core.errors import PackageError
from trt_builder.triton.repositories import validate_repository
from trt_builder.triton.repository import RepositoryOptions, write_repository

OPTS = RepositoryOptions(
    max_batch_size=4,
    max_input_len=64,
    max_seq_len=128,
    max_beam_width=1,
    engine_path="/models/x/tensorrt_llm/1/engine",
)


@pytest.fixture
def repo(tmp_path: Path, tokenizer_dir: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    write_repository(root, OPTS, sorted(tokenizer_dir.iterdir()), None)
    return root


def test_every_pinned_release_has_its_backend_contract() -> None:
    from trt_builder.engine.releases import RELEASES
    from trt_builder.triton.conformance import CONTRACTS

    assert sorted(CONTRACTS) == sorted(r.version for r in RELEASES)
    for contract in CONTRACTS.values():
        assert contract.evidence in ("read", "probable", "inferred") and contract.dated_by
        for entry in (*contract.parameters, *contract.inputs, *contract.outputs):
            assert entry.source.repo and entry.source.path and entry.source.version, entry


@pytest.mark.parametrize("release", ["0.20", "0.21", "1.0", "1.1", "1.2"])
def test_the_tensorrt_llm_config_meets_the_backend_of_each_release(
    repo: Path, release: str
) -> None:
    """The written config.pbtxt, as Triton parses it, against what that release's backend reads:
    every parameter it reads unguarded is there (a missing one fails the model's load), every
    input is one the backend looks up, by that name, type and dims (a misnamed one would be
    accepted and never read), every required template input and every output is there."""
    from trt_builder.triton.conformance import CONTRACTS

    contract = CONTRACTS[release]
    config = mc.ModelConfig()
    text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), config)
    for parameter in contract.parameters:
        assert parameter.name in config.parameters, (parameter.name, str(parameter.source))
    assert config.parameters["gpt_model_type"].string_value in (
        "V1", "v1", "inflight_batching", "inflight_fused_batching"
    )  # fmt: skip
    for key in ("xgrammar_tokenizer_info_path", "guided_decoding_backend"):
        assert config.parameters[key].string_value == ""  # no guided decoding
    sent = {i.name: i for i in config.input}
    for name, item in sent.items():
        spec = contract.input(name)
        assert spec is not None, f"{name} is not an input the {release} backend reads"
        assert mc.DataType.Name(item.data_type) == spec.data_type, name
        assert tuple(item.dims) == spec.dims, name
    assert {s.name for s in contract.inputs if not s.optional} <= set(sent)
    assert "seed" in sent and "random_seed" not in sent
    outputs = {o.name: (mc.DataType.Name(o.data_type), tuple(o.dims)) for o in config.output}
    assert outputs == {s.name: (s.data_type, s.dims) for s in contract.outputs}


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
        # the ensemble (the BLS model) names its steps in its `steps` parameter: JSON, escaped
        (
            "ensemble",
            '[[\\"preprocessing\\", {',
            '[[\\"preprocess\\", {',
            "step model 'preprocess' is not in the repository",
        ),
        ("ensemble", '\\"QUERY\\"', '\\"PROMPT\\"', "preprocessing has no input 'PROMPT'"),
        (
            "ensemble",
            '\\"input_lengths\\": \\"_REQUEST_INPUT_LEN\\"',
            '\\"input_lengths\\": \\"_INPUT_LEN\\"',
            "tensor '_INPUT_LEN' feeding tensorrt_llm.input_lengths is produced by no earlier step",
        ),
        (
            "ensemble",
            "model_transaction_policy {\n}",
            "model_transaction_policy {\n  decoupled: true\n}",
            "model ensemble: its last step must be a decoupled tensorrt_llm model",
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
            "tensorrt_llm",
            'name: "input_ids"\n  data_type: TYPE_INT32\n  dims: -1',
            'name: "input_ids"\n  data_type: TYPE_INT32\n  dims: -1\n  dims: -1',
            "'_INPUT_ID' has dims [-1] but tensorrt_llm.input_ids takes [-1, -1]",
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
        '\\"input_lengths\\": \\"_REQUEST_INPUT_LEN\\", ',
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
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo / "preprocessing" / "tokenizer")
    # the ids the Rust tokenizer itself gives (no transformers wrapper, nor the model's code)
    raw = Tokenizer.from_file(str(repo / "preprocessing" / "tokenizer" / "tokenizer.json"))
    pre = _module(repo, "preprocessing")
    text = "The quick brown fox — naïve café 1, 2, 3"
    ids = pre.encode_query(tok, text, add_special_tokens=True, max_input_len=64)
    assert ids == raw.encode(text, add_special_tokens=True).ids and len(ids) > 10
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


TEXTS = ["naïve café, 東京 and 🙂🎉 — ok", "Hello , world . Don't stop ; it's fine !"]


def _metaspace_tokenizer(path: Path) -> Path:
    """A SentencePiece-style tokenizer (Metaspace, as Llama's), whose decode strips the first
    word's space and cleans up the spaces before punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )  # Llama's
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]  # characters outside the alphabet: as bytes
    trainer = trainers.BpeTrainer(
        vocab_size=320, limit_alphabet=24, special_tokens=["<unk>", *bytes_]
    )
    tok.train_from_iterator(TEXTS * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   clean_up_tokenization_spaces=True)  # fmt: skip
    fast.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_streamed_pieces_are_whole_characters_and_concatenate_to_the_answer(
    tmp_path: Path, tokenizer_dir: Path, kind: str
) -> None:
    """tensorrt_llm_bls's detokenizer, fed one token at a time (as a stream comes): its pieces
    join to exactly the decode of the whole answer and none holds a broken character, where
    decoding each token alone (the ensemble's postprocessing) breaks them."""
    from transformers import AutoTokenizer

    where = tokenizer_dir if kind == "byte-level" else _metaspace_tokenizer(tmp_path / "sp")
    tok = AutoTokenizer.from_pretrained(where)
    root = tmp_path / "repo"
    root.mkdir()
    write_repository(root, replace(OPTS, decoupled=True), sorted(tokenizer_dir.iterdir()), None)
    bls = _module(root, "tensorrt_llm_bls")
    broken = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        whole = tok.decode(ids, skip_special_tokens=True)
        broken.append("".join(tok.decode([i], skip_special_tokens=True) for i in ids) != whole)
        stream = bls.TextStream(tok, skip_special_tokens=True)
        pieces = [stream.add([i]) for i in ids]
        pieces.append(stream.finish())
        assert "".join(pieces) == whole
        assert not any("\ufffd" in piece for piece in pieces)
        # streamed, not held to the end: most of the text is out before the stream finishes
        # (a count of non-empty pieces would depend on how the trained tokenizer splits)
        assert len("".join(pieces[:-1])) >= len(whole) * 3 // 4 and len(pieces[:-1]) > 1
    # the failure this is for: decoded alone, the characters break (and Metaspace's spaces go)
    assert broken == [True, kind == "metaspace"]
    # a stream that ends inside a character gives what the whole answer decodes to
    ids = tok.encode("🙂", add_special_tokens=False)[:-1]
    stream = bls.TextStream(tok, skip_special_tokens=True)
    assert [stream.add([i]) for i in ids] == [""] * len(ids)
    assert stream.finish() == tok.decode(ids, skip_special_tokens=True)


def test_a_streaming_repository_has_the_bls_model_wired_as_the_ensemble(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    write_repository(root, replace(OPTS, decoupled=True), sorted(tokenizer_dir.iterdir()), None)
    configs = validate_repository(root)
    bls = configs["tensorrt_llm_bls"]
    ensemble = configs["ensemble"]
    assert bls.backend == "python" and bls.model_transaction_policy.decoupled
    assert [(t.name, t.data_type, list(t.dims), t.optional) for t in bls.input] == [
        (t.name, t.data_type, list(t.dims), t.optional) for t in ensemble.input
    ]
    assert [t.name for t in bls.output] == ["text_output"]
    for key in ("accumulate_tokens", "tensorrt_llm_model_name"):  # upstream's BLS parameters
        assert key in bls.parameters
    assert (root / "tensorrt_llm_bls" / "1" / "model.py").is_file()
    _edit(root, "tensorrt_llm_bls", "REQUEST_OUTPUT_LEN", "OUTPUT_LEN")
    with pytest.raises(PackageError, match="preprocessing has no input 'OUTPUT_LEN'"):
        validate_repository(root)
    # the ensemble is the same model, under its own name
    assert ensemble.backend == "python" and ensemble.model_transaction_policy.decoupled
    assert [(k, v.string_value) for k, v in sorted(ensemble.parameters.items())] == [
        (k, v.string_value) for k, v in sorted(bls.parameters.items())
    ]
    source = (root / "tensorrt_llm_bls" / "1" / "model.py").read_text()
    assert (root / "ensemble" / "1" / "model.py").read_text() == source
    plain = tmp_path / "plain"
    plain.mkdir()
    write_repository(plain, OPTS, sorted(tokenizer_dir.iterdir()), None)
    configs = validate_repository(plain)
    assert "tensorrt_llm_bls" not in configs
    assert configs["ensemble"].backend == "python" and not configs["ensemble"].platform
    assert not configs["ensemble"].model_transaction_policy.decoupled
    assert (plain / "ensemble" / "1" / "model.py").read_text() == source


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


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {
            "role": "user",
            "content": "Ünïcödé: naïve café, 日本語のテキスト, emoji 🦊🚀, Ωμέγα — “quotes”",
        }
    ],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is prime."},
        {"role": "user", "content": "And an even one?"},
    ],
    [{"role": "user", "content": " ".join(["The quick brown fox jumps over the lazy dog."] * 120)}],
    [{"role": "user", "content": "<|im_start|> tokens typed by a user, and\ttabs\nnewlines  "}],
]


@pytest.mark.integration
def test_preprocessing_matches_apply_chat_template_on_smollm2(
    smollm2_hf: Path, tmp_path: Path
) -> None:
    """The real SmolLM2 tokenizer and chat template: the sandboxed rendering and encoding
    give exactly apply_chat_template(add_generation_prompt=True, tokenize=True)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf)
    assert tok.chat_template
    root = tmp_path / "repo"
    root.mkdir()
    write_repository(
        root, OPTS, [p for p in smollm2_hf.iterdir() if p.suffix != ".safetensors"], None
    )
    pre = _module(root, "preprocessing")
    env = pre.chat_environment()
    for chat in CHATS:
        want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
        got = pre.encode_chat(tok, pre.parse_messages(json.dumps(chat)), max_input_len=0,
                              environment=env)  # fmt: skip
        assert got == want, chat[0]["content"][:40]
        assert pre.render_chat(tok, chat, environment=env) == tok.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
    # plain text: encode with the tokenizer's special tokens, as the Rust tokenizer does
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(smollm2_hf / "tokenizer.json"))
    text = "Ünïcödé 🦊 and plain words"
    ids = pre.encode_query(tok, text, add_special_tokens=True, max_input_len=0)
    assert ids == raw.encode(text, add_special_tokens=True).ids
    assert raw.decode(ids) == text
    # the whole request path, batch of two chats
    out = pre.preprocess(
        tok,
        {"MESSAGES": np.array([[json.dumps(CHATS[0]).encode()], [json.dumps(CHATS[2]).encode()]],
                              dtype=object),
         "REQUEST_OUTPUT_LEN": np.array([[8], [8]], dtype=np.int32)},
        add_special_tokens=True, max_input_len=1024, end_id=2, pad_id=2, max_seq_len=2048,
    )  # fmt: skip
    first = tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True)
    first = list(first["input_ids"] if hasattr(first, "keys") else first)
    assert out["REQUEST_INPUT_LEN"][0, 0] == len(first)
    assert out["INPUT_ID"][0, : len(first)].tolist() == first


def test_bad_requests_get_clear_errors(repo: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo / "preprocessing" / "tokenizer")
    pre = _module(repo, "preprocessing")

    def request(**inputs: object) -> dict:
        base = {"REQUEST_OUTPUT_LEN": np.array([[8]], dtype=np.int32)}
        arrays = {k: np.array([[v]], dtype=object if isinstance(v, bytes) else np.int32)
                  for k, v in inputs.items()}  # fmt: skip
        return pre.preprocess(tok, {**base, **arrays}, add_special_tokens=True, max_input_len=64,
                              end_id=2, pad_id=0, max_seq_len=70)  # fmt: skip

    cases = [
        ({}, r"send one of text_input \(plain text\) and messages"),
        ({"QUERY": b"hi", "MESSAGES": b"[]"}, "send one of text_input"),
        ({"QUERY": b"   "}, "empty prompt"),
        ({"QUERY": "fox ".join([""] * 200).encode()}, "the engine accepts at most 64"),
        ({"MESSAGES": b"not json"}, "messages is not JSON"),
        ({"MESSAGES": b'[{"content": "x"}]'}, 'messages\\[0\\] needs a "role"'),
        ({"MESSAGES": b"[]"}, "non-empty JSON list"),
        ({"QUERY": b"The quick brown fox", "REQUEST_OUTPUT_LEN": 68}, "exceeds the engine's max_seq_len 70"),
        ({"QUERY": b"The quick brown fox", "REQUEST_OUTPUT_LEN": 0}, "ask for at least 1 token"),
    ]  # fmt: skip
    for inputs, message in cases:
        with pytest.raises(ValueError, match=message):
            request(**inputs)


def test_chat_templates_run_sandboxed(repo: Path) -> None:
    from jinja2.exceptions import SecurityError, TemplateError
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo / "preprocessing" / "tokenizer")
    pre = _module(repo, "preprocessing")
    chat = [{"role": "user", "content": "hi"}]
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        pre.render_chat(tok, chat)
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(TemplateError, match="only user turns"):
        pre.render_chat(tok, chat)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template: send text_input instead"):
        pre.render_chat(tok, chat)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("dtype", "tp"), [("float16", 1), ("float16", 2), ("int8", 1), ("int8", 2)]
)
def test_packaged_repositories_validate_and_publish_versions(
    tiny_llama: Path, tmp_path: Path, dtype: str, tp: int
) -> None:
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec
    from trt_builder.triton.repository import INFO, current_version, published_versions

    def build(**flags: object):  # type: ignore[no-untyped-def]
        # NVIDIA's backend, its engine to come (a CPU host's default is the reference backend)
        flags = {"triton.backend": "tensorrtllm", **flags}
        spec = make_spec(model=str(tiny_llama), dtype=dtype, tp=tp, out=tmp_path / "engines",
                         triton_root=tmp_path / "triton", **flags)  # fmt: skip
        return run(spec, only=("fetch", "calibrate", "recipe", "convert", "package"))

    assert run(make_spec(model=str(tiny_llama), dtype=dtype, tp=tp, out=tmp_path / "engines",
                         triton_root=tmp_path / "auto"),
               only=("fetch", "calibrate", "recipe", "convert", "package")).records[-1].details[
        "backend"] == "reference"  # fmt: skip
    result = build()
    link = result.layout.triton
    assert link.is_symlink() and current_version(link) == 1
    configs = validate_repository(link)
    info = json.loads((link / INFO).read_text())
    assert info["world_size"] == tp and info["engine_included"] is False
    llm = configs["tensorrt_llm"].parameters
    assert (
        llm["gpt_model_path"].string_value
        == f"{link.resolve().parents[2]}/{link.name}/tensorrt_llm/1/engine"
    )
    assert llm["enable_chunked_context"].string_value == "true"  # paged context FMHA is on
    assert configs["tensorrt_llm"].max_batch_size == result.spec.limits.max_batch_size
    assert not configs["tensorrt_llm"].model_transaction_policy.decoupled
    # the launch command: one tritonserver, or mpirun with a rank per GPU (leader mode)
    from trt_builder.triton.serve import serve_command

    argv = serve_command(link)
    served = f"--model-repository={link.resolve().parents[2]}/{link.name}"
    ranks = [r for r in " ".join(argv).split(" : ")]
    assert len(ranks) == tp and all(served in r and "--strict-readiness=true" in r for r in ranks)
    assert "--load-model=ensemble" in ranks[0] and "--exit-on-error=true" in ranks[0]
    assert all("--exit-timeout-secs=10" in r for r in ranks)  # a bounded drain on SIGTERM
    assert (argv[0] == "tritonserver") == (tp == 1)
    if tp == 2:
        assert argv[:5] == ["mpirun", "--allow-run-as-root", "-n", "1", "tritonserver"]
        assert "--load-model=tensorrt_llm" in ranks[1] and "--load-model=ensemble" not in ranks[1]
        assert "shm-region-prefix-name=prefix1_" in ranks[1]
    # unchanged: no new version; a changed [triton] table: version 2, then 3; keep 2
    assert build().records[-1].status == "cached" and current_version(link) == 1
    build(**{"triton.streaming": True, "triton.keep": 2})
    assert current_version(link) == 2
    assert validate_repository(link)["tensorrt_llm"].model_transaction_policy.decoupled
    build(**{"triton.kv_cache_free_gpu_mem_fraction": 0.8, "triton.keep": 2})
    assert current_version(link) == 3 and published_versions(link) == [2, 3]
    assert (link / "tensorrt_llm" / "3").is_dir() and not (link / "tensorrt_llm" / "2").exists()
    assert not [p for p in link.parent.iterdir() if ".tmp-" in p.name]
    # served from a container that mounts the Triton root at /models
    build(**{"triton.serve_root": "/models", "triton.keep": 2})
    assert f"--model-repository=/models/{link.name}" in serve_command(link)


@pytest.mark.integration
def test_a_failed_publish_leaves_the_current_version(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trt_builder.pipeline.build import run
    from trt_builder.spec.build import make_spec
    from trt_builder.targets.engine import triton as engine_repository
    from trt_builder.triton.repository import current_version

    def spec(**flags: object):  # type: ignore[no-untyped-def]
        return make_spec(model=str(tiny_llama), dtype="float32", out=tmp_path / "engines",
                         triton_root=tmp_path / "triton", **flags)  # fmt: skip

    link = run(spec(), only=("fetch", "convert", "package")).layout.triton
    before = sorted(p.relative_to(link.parent) for p in link.parent.rglob("*"))

    def broken(work: Path, *args: object) -> None:
        (work / "ensemble").mkdir()
        (work / "ensemble" / "config.pbtxt").write_text("half written")
        raise PackageError("injected failure while writing")

    monkeypatch.setattr(engine_repository, "write_repository", broken)
    with pytest.raises(PackageError, match="injected"):
        run(spec(**{"triton.streaming": True}), only=("package",))
    assert current_version(link) == 1
    assert sorted(p.relative_to(link.parent) for p in link.parent.rglob("*")) == before
    validate_repository(link)


def test_options_follow_the_engine_config() -> None:
    from trt_builder.triton.repository import options_from_engine

    engine = {
        "pretrained_config": {"mapping": {"world_size": 4, "tp_size": 2, "pp_size": 2}},
        "build_config": {"max_batch_size": 64, "max_input_len": 512, "max_seq_len": 1024,
                         "max_beam_width": 2, "kv_cache_type": "PAGED",
                         "plugin_config": {"use_paged_context_fmha": False}},
    }  # fmt: skip
    opts = options_from_engine(engine, engine_path="/models/e", version=5, decoupled=True,
                               kv_cache_free_gpu_mem_fraction=0.85)  # fmt: skip
    assert (opts.max_batch_size, opts.max_input_len, opts.max_seq_len, opts.max_beam_width) == (
        64,
        512,
        1024,
        2,
    )
    assert opts.world_size == 4 and opts.version == 5 and opts.decoupled
    # the INT8 KV cache turns paged context FMHA off: no chunked context, no KV reuse
    assert not opts.enable_chunked_context and not opts.enable_kv_cache_reuse
    with pytest.raises(PackageError, match="lacks what the repository needs.*rebuild the engine"):
        options_from_engine({"pretrained_config": {}}, engine_path="/e", version=1,
                            decoupled=False, kv_cache_free_gpu_mem_fraction=0.9)  # fmt: skip
