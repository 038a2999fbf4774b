"""Repositories trt-builder packages, served by a real tritonserver (the nvidia-pytriton wheel's
2.51 with the Python backend: `trt-builder[serve]`), the tensorrt_llm model on the reference
backend. Not a stand-in: Triton's own ensemble scheduler, Python backend and protocols."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trt_builder.cli.main import main
from trt_builder.core.errors import TritonError
from trt_builder.pipeline import run
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.spec.build import make_spec
from trt_builder.triton.runtime import TritonRuntime
from trt_builder.triton.server import Server, start

pytestmark = [pytest.mark.integration, pytest.mark.triton]

PROMPTS = [[5, 17, 42, 99], [7, 250, 3], [64, 128, 11, 300, 21, 8]]


def _ports(log: Path) -> dict[str, Any]:
    """Free ports for a server, and where its log goes (the test's own directory)."""
    sockets = [socket.socket() for _ in range(3)]  # held together: three distinct ports
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    found = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return {**dict(zip(("http_port", "grpc_port", "metrics_port"), found, strict=True)), "log": log}


#: How far below the checkpoint runtime's best logit a served token may be, where an answer
#: with FP8 activations leaves the runtime's own greedy path: an e4m3 rounding that lands on
#: the other neighbour in another process carries through the layers (docs/benchmarks.md, "How
#: far verify's figures move"), and the default fp8 model's answer to the boiling-point chat
#: has near-ties (0.004 and 0.24 logit along its decoded path): CI's machine once streamed "100
#: degrees Celsius" where the runtime said "100°C". A wrong model leaves the path at a token
#: the runtime ranks several logits lower (that answer's other steps: 2.2 to 7.9).
NEAR_TIE = 0.5


def _answers_as(runtime: CheckpointRuntime, tokenizer: Any, ids: list[int], text: str,
                want: list[int]) -> bool:  # fmt: skip
    """Whether `text` is the runtime's greedy answer `want` to `ids`, or a path that leaves it
    only at near-ties: each of the text's tokens within NEAR_TIE of the runtime's best logit at
    its step, decoded through the runtime's KV cache as greedy decodes."""
    import torch

    if text == tokenizer.decode(want, skip_special_tokens=True):
        return True
    tokens = tokenizer(text, add_special_tokens=False).input_ids
    if not tokens:
        return False
    full = torch.tensor([ids + tokens])
    with torch.inference_mode():
        logits = runtime.forward_decoded(full, len(ids))[0, len(ids) - 1 : -1].float()
    gaps = logits.max(-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return float(gaps.max()) <= NEAR_TIE


def _package(model: Path, root: Path, **spec: Any) -> tuple[Any, Path]:
    """Build the model up to the Triton repository: (the build result, the repository)."""
    result = run(make_spec(model=str(model), out=root / "engines", triton_root=root / "triton",
                           **{"verify.heldout_tokens": 128, **spec}))  # fmt: skip
    return result, result.layout.triton


@pytest.fixture(scope="module")
def tiny(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """tiny Llama in float32, packaged twice (plain and streaming), each repository served."""
    root = tmp_path_factory.mktemp("served")
    build, plain = _package(tiny_llama, root, dtype="float32")
    _, streaming = _package(tiny_llama, root / "s", dtype="float32", **{"triton.streaming": True})
    runtime = CheckpointRuntime.load(build.layout.checkpoint)
    with (
        start(plain, **_ports(root / "a.log")) as a,
        start(streaming, **_ports(root / "b.log")) as b,
    ):
        yield {"plain": a, "streaming": b, "runtime": runtime, "hf": build.layout.hf,
               "repository": plain, "streaming_repository": streaming}  # fmt: skip


def _ids_request(module: Any, ids: list[int], tokens: int, **extra: Any) -> list[Any]:
    """Inputs of one request straight to the tensorrt_llm model (no end id: it runs `tokens`)."""

    values = {"input_ids": np.array([ids], np.int32),
              "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[tokens]], np.int32),
              **{k: np.array([[v]]) for k, v in extra.items()}}  # fmt: skip
    inputs = []
    for name, value in values.items():
        item = module.InferInput(
            name, list(value.shape), "BOOL" if value.dtype == bool else "INT32"
        )
        item.set_data_from_numpy(value)
        inputs.append(item)
    return inputs


def test_the_reference_backend_answers_as_the_checkpoint_runtime(tiny: dict[str, Any]) -> None:
    """Greedy token ids from the tensorrt_llm model, over HTTP and gRPC, and streamed: the
    checkpoint runtime's own greedy generation, token for token."""
    runtime: CheckpointRuntime = tiny["runtime"]
    want = [runtime.greedy(p, 12, {2}) for p in PROMPTS]
    plain: Server = tiny["plain"]
    for url in (plain.http_url, plain.grpc_url):
        assert TritonRuntime(url).greedy_batch(PROMPTS, 12, {2}) == want, url
    streamed = TritonRuntime(tiny["streaming"].grpc_url)
    assert streamed.decoupled and streamed.greedy_batch(PROMPTS, 12, {2}) == want
    # the streamed ids are gathered to the final response and cut at the end id
    end = want[0][2]
    assert streamed.greedy_batch(PROMPTS[:1], 12, {end}) == [want[0][: want[0].index(end) + 1]]


def test_verify_passes_against_the_served_repository(
    tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify --runtime triton over HTTP, and over the gRPC stream of the streaming one."""
    for url in (tiny["plain"].http_url, tiny["streaming"].grpc_url):
        code = main(["verify", "--runtime", "triton", "--url", url, "--reference",
                     str(tiny["hf"]), "--dtype", "float32", "--report", str(tmp_path / "v.json"),
                     "--json"])  # fmt: skip
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["passed"], (url, report["failures"])
        assert report["greedy_agreement"] == 1.0 and report["runtime"] == "triton"


def test_streamed_text_is_the_answer_whole_over_the_bls_model(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """The plain repository's answer; the streaming one's, streamed by tensorrt_llm_bls (infer
    --stream's default there) and by its ensemble (the same BLS model), whose pieces join to
    exactly that answer, where decoding each token alone (what Triton's ensemble did with a
    stream) breaks this answer's characters; and a non-streamed request to the BLS model gets
    the answer in one response."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["repository"] / "preprocessing" / "tokenizer")
    prompt = "The quick brown fox"
    tokens = tiny["runtime"].greedy(tokenizer.encode(prompt), 24, {2})
    want = tokenizer.decode(tokens, skip_special_tokens=True)
    alone = "".join(tokenizer.decode([t], skip_special_tokens=True) for t in tokens)
    # byte tokens of one character, decoded apart, each become U+FFFD
    assert alone.count("\ufffd") > want.count("\ufffd")
    args = ["--prompt", prompt, "--max-tokens", "24"]
    assert main(["infer", "--url", tiny["plain"].http_url, *args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == want
    grpc = tiny["streaming"].grpc_url
    assert main(["infer", "--url", grpc, *args, "--stream", "--json"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed["model"] == "tensorrt_llm_bls" and streamed["text"] == want
    assert main(["infer", "--url", grpc, *args, "--stream"]) == 0
    assert capsys.readouterr().out == want + "\n"  # printed as they came, then a newline
    # the streaming repository's ensemble is the BLS model too: its stream is as whole
    assert main(["infer", "--url", grpc, *args, "--stream", "--model", "ensemble", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == want
    # the pieces as they arrive: several when streamed, one when not
    from trt_builder.triton import client

    module, server, _ = client.connect(grpc)
    for stream in (True, False):
        inputs = client._inputs(module, client.Request(prompt=prompt, max_tokens=24), stream)
        pieces = [r.as_numpy("text_output") for r in client.stream_results(
            server, "tensorrt_llm_bls", inputs, timeout=60)]  # fmt: skip
        texts = [p.reshape(-1)[0].decode() for p in pieces if p is not None]
        assert "".join(texts) == want
        assert len(texts) > 3 if stream else len(texts) == 1


def test_infer_sends_what_the_ensemble_declares_and_the_seed_is_honoured(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Sampling options and the seed through the real ensemble (Triton refuses an input it
    does not declare): one seed gives one answer, other seeds others."""
    url = tiny["plain"].http_url

    def sampled(seed: int) -> str:
        assert main(["infer", "--url", url, "--prompt", "Ünïcode prompt", "--max-tokens", "12",
                     "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed",
                     str(seed), "--json"]) == 0  # fmt: skip
        return str(json.loads(capsys.readouterr().out)["text"])

    first = sampled(7)
    assert sampled(7) == first
    assert len({first, *(sampled(seed) for seed in (1, 2, 3))}) > 1


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--model", "other"], 12, "Request for unknown model: 'other'"),
        (["--stream"], 3, "--stream needs a gRPC URL"),
    ],
)
def test_infer_errors_are_one_line_with_their_exit_code(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str], args: list[str], code: int,
    message: str,
) -> None:  # fmt: skip
    url = tiny["plain"].http_url
    assert main(["infer", "--url", url, "--prompt", "x", *args]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert main(["infer", "--url", url, "--prompt", "still there?", "--max-tokens", "2"]) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "   "], "empty prompt"),
        (["--prompt", "fox " * 1500], "the engine accepts at most 1024"),
        (["--messages", '[{"role": "wizard", "content": "hi"}]'], "has role 'wizard'"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    url = tiny["plain"].http_url
    assert main(["infer", "--url", url, *args, "--max-tokens", "4"]) == 12
    assert message in capsys.readouterr().err
    assert main(["infer", "--url", url, "--prompt", "still there?", "--max-tokens", "2"]) == 0


def test_messages_that_are_not_json_get_the_preprocessing_models_error(
    tiny: dict[str, Any],
) -> None:
    """Sent as raw bytes (infer refuses them before sending): the server's own answer."""
    import tritonclient.http as http

    client = http.InferenceServerClient(tiny["plain"].http_url.removeprefix("http://"))
    messages = http.InferInput("messages", [1, 1], "BYTES")
    messages.set_data_from_numpy(np.array([[b"[{not json"]], dtype=object))
    tokens = http.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    with pytest.raises(Exception, match="messages is not JSON"):
        client.infer("ensemble", [messages, tokens])
    assert client.is_server_ready() and client.is_model_ready("ensemble")


def test_max_tokens_zero_is_refused_before_the_request(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["infer", "--url", tiny["plain"].http_url, "--prompt", "x", "--max-tokens", "0"]) == 3
    )
    assert "--max-tokens must be at least 1" in capsys.readouterr().err


def test_a_request_without_max_tokens_is_refused_in_words_on_every_endpoint(
    tiny: dict[str, Any],
) -> None:
    """Before: HTTP 200 with Triton's "expects model to produce exactly 1 response" from
    /generate, an empty stream from /generate_stream (the ensemble ended with no response)."""
    import urllib.error
    import urllib.request

    import tritonclient.grpc as grpc

    said = "max_tokens is missing: send max_tokens"
    for server, model, path in ((tiny["plain"], "ensemble", "generate"),
                                (tiny["streaming"], "ensemble", "generate"),
                                (tiny["streaming"], "ensemble", "generate_stream"),
                                (tiny["streaming"], "tensorrt_llm_bls", "generate"),
                                (tiny["streaming"], "tensorrt_llm_bls", "generate_stream")):  # fmt: skip
        request = urllib.request.Request(f"{server.http_url}/v2/models/{model}/{path}",
                                         data=json.dumps({"text_input": "Hello"}).encode())  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400, (model, path)
        assert said in refused.value.read().decode(), (model, path)
    client = grpc.InferenceServerClient(tiny["plain"].grpc_url.removeprefix("grpc://"))
    text = grpc.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hello"]], dtype=object))
    with pytest.raises(Exception, match=said):
        client.infer("ensemble", [text], timeout=30)
    tokens = grpc.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[2]], dtype=np.int32))
    answer = client.infer("ensemble", [text, tokens], timeout=30).as_numpy("text_output")
    assert answer is not None and answer.size == 1  # the same request with it is answered


def test_a_second_serve_on_busy_ports_names_the_port_and_what_holds_it(
    tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "serving ... on http://..." (the first server's readiness taken for its own),
    then "tritonserver exited with 1"; the cause only in tritonserver's log."""
    first = tiny["plain"]
    free = _ports(tmp_path / "unused.log")
    args = ["serve", str(tiny["repository"]), "--grpc-port", str(free["grpc_port"]),
            "--metrics-port", str(free["metrics_port"])]  # fmt: skip
    assert main([*args, "--http-port", str(first.http_port)]) == 3
    err = capsys.readouterr().err
    assert f"port {first.http_port} (--http-port) is in use: another Triton server answers" in err
    assert "serving" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with socket.socket() as other:  # a process that is not Triton
        other.bind(("127.0.0.1", 0))
        other.listen()
        busy = other.getsockname()[1]
        assert main([*args, "--http-port", str(free["http_port"]),
                     "--grpc-port", str(busy)]) == 3  # fmt: skip
    err = capsys.readouterr().err
    assert f"port {busy} (--grpc-port) is in use: another process listens on it" in err
    assert "serving" not in err
    assert TritonRuntime(first.grpc_url).greedy_batch([[5, 17, 42]], 2, {2})  # still serving


def test_stop_is_safe_on_a_server_that_has_exited_and_ends_what_it_left(tmp_path: Path) -> None:
    """stop() on a server whose process already exited neither raises nor leaves the rest of
    its group (a backend stub, here a child shell) running."""
    import os
    import subprocess
    import time

    pidfile = tmp_path / "child"
    process = subprocess.Popen(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; exit 0"],
                               start_new_session=True)  # fmt: skip
    process.wait()
    child = int(pidfile.read_text())
    server = Server(process, 1, 2, tmp_path / "log", None, None)  # type: ignore[arg-type]
    assert server.stop(grace=5) == 0 and not server.killed
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
            break  # gone, or a zombie awaiting a reaper
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the exited server's child was left running")


def test_the_default_model_in_int8_serves_its_chat_template(
    default_build: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SmolLM2-135M-Instruct's int8 SmoothQuant repository from the README's build: a chat,
    rendered with the model's own template, answered as the checkpoint runtime answers it."""
    from transformers import AutoTokenizer

    cwd, result = default_build
    repository = Path(result["triton_repository"])
    checkpoint = Path(result["variant_dir"]) / "checkpoint"
    tokenizer = AutoTokenizer.from_pretrained(repository / "preprocessing" / "tokenizer")
    chat = [{"role": "user", "content": "What is the boiling point of water?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = CheckpointRuntime.load(checkpoint).greedy(ids, 12, {tokenizer.eos_token_id})
    with start(repository, **_ports(tmp_path / "server.log")) as server:
        assert main(["infer", "--url", server.grpc_url, "--messages", json.dumps(chat),
                     "--max-tokens", "12", "--json"]) == 0  # fmt: skip
    text = json.loads(capsys.readouterr().out)["text"]
    assert text == tokenizer.decode(want, skip_special_tokens=True) and "100" in text


@pytest.fixture(scope="module")
def default_variants(default_variant: Any) -> dict[str, tuple[Any, Path]]:
    """SmolLM2-135M-Instruct's mode matrix rows float16 (plain), int8 with the INT8 KV cache
    (packaged streaming) and fp8 with the FP8 KV cache (plain), from the default build's cache
    (tests/conftest.py: default_variant): the build result and the repository of each."""
    builds = {
        "float16": default_variant(dtype="float16"),
        "int8-kv8": default_variant(dtype="int8", kv_cache="int8", **{"triton.streaming": True}),
        "fp8-fp8kv": default_variant(dtype="fp8", kv_cache="fp8"),
    }
    return {name: (result, result.layout.triton) for name, result in builds.items()}


CHATS = [
    [{"role": "user", "content": "What is the boiling point of water?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "What colour is the sky?"}],
]  # fmt: skip


@pytest.mark.parametrize("variant", ["float16", "int8-kv8", "fp8-fp8kv"])
def test_the_default_model_serves_in_float16_int8_and_fp8(
    default_variants: dict[str, tuple[Any, Path]], smollm2_hf: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], variant: str,
) -> None:  # fmt: skip
    """Each repository loads, and answers chats (the model's own template) as the checkpoint
    runtime answers them, over gRPC (streamed where the repository streams) and, for fp8, over
    HTTP too; in float16 also as transformers does in float16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result, repository = default_variants[variant]
    config = json.loads((result.layout.checkpoint / "config.json").read_text())
    want_kv = {"int8-kv8": "INT8", "fp8-fp8kv": "FP8"}.get(variant)
    assert config["quantization"]["kv_cache_quant_algo"] == want_kv
    algo = {"int8-kv8": "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "fp8-fp8kv": "FP8"}.get(variant)
    assert config["quantization"]["quant_algo"] == algo
    tokenizer = AutoTokenizer.from_pretrained(repository / "preprocessing" / "tokenizer")
    runtime = CheckpointRuntime.load(result.layout.checkpoint)
    hf = None
    if variant == "float16":
        hf = AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float16)
    stream = ["--stream"] if variant == "int8-kv8" else []
    with start(repository, **_ports(tmp_path / "server.log")) as server:
        for chat in CHATS:
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            want = runtime.greedy(ids, 12, {tokenizer.eos_token_id})
            if hf is not None:
                out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
                assert out[0, len(ids) : len(ids) + len(want)].tolist() == want
            urls = [server.grpc_url] + ([server.http_url] if variant == "fp8-fp8kv" else [])
            for url in urls:
                assert main(["infer", "--url", url, "--messages", json.dumps(chat),
                             "--max-tokens", "12", "--json", *stream]) == 0  # fmt: skip
                text = json.loads(capsys.readouterr().out)["text"]  # streamed: tensorrt_llm_bls
                assert text.strip() and _answers_as(runtime, tokenizer, ids, text, want), text


@pytest.mark.parametrize("dtype,kv", [("float16", "model"), ("fp8", "model"), ("fp8", "fp8")])
def test_the_default_model_llmapi_repositories_answer_as_the_checkpoint_runtime(
    default_variant: Any, tmp_path: Path, dtype: str, kv: str
) -> None:
    """--target llmapi of the default model in float16, fp8 and fp8 with the FP8 KV cache (the
    mode matrix's rows, from the default build's cache), packaged plain and streaming: each
    answers a rendered chat as the checkpoint runtime answers it, over HTTP and gRPC, and
    streamed over gRPC."""
    from transformers import AutoTokenizer

    from trt_builder.triton import client

    spec = {"target": "llmapi", "dtype": dtype, "kv_cache": kv}
    result = default_variant(**spec)
    plain = result.layout.triton
    streaming = default_variant(**spec, **{"triton.streaming": True}).layout.triton
    assert {r.name: r.status for r in result.records}["verify"] in ("ran", "cached")
    tokenizer = AutoTokenizer.from_pretrained(result.layout.checkpoint)
    runtime = CheckpointRuntime.load(result.layout.checkpoint)
    with (
        start(plain, **_ports(tmp_path / "plain.log")) as a,
        start(streaming, **_ports(tmp_path / "streaming.log")) as b,
    ):
        for chat in CHATS:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text).input_ids
            want = runtime.greedy(ids, 12, {tokenizer.eos_token_id})
            assert tokenizer.decode(want, skip_special_tokens=True).strip()
            request = client.Request(prompt=text, max_tokens=12)
            answers = [client.generate(url, request) for url in (a.http_url, a.grpc_url)]
            answers.append("".join(client.stream(b.grpc_url, request)))
            for answer in answers:
                assert _answers_as(runtime, tokenizer, ids, answer, want), (answer, want)


def test_a_repository_that_does_not_load_names_the_model_and_triton_s_reason(
    tiny: dict[str, Any], tmp_path: Path, tiny_llama: Path
) -> None:
    """The same build packaged for NVIDIA's backend, which this tritonserver does not have."""
    _, repository = _package(
        tiny_llama, tmp_path, dtype="float32", **{"triton.backend": "tensorrtllm"}
    )
    with pytest.raises(TritonError, match=r"model tensorrt_llm failed to load: .*tensorrtllm"):
        start(repository, timeout=120, **_ports(tmp_path / "server.log"))


def test_the_reference_backend_refuses_what_it_cannot_run_before_it_joins_the_batch(
    tiny: dict[str, Any],
) -> None:
    """Straight to tensorrt_llm (no preprocessing limits): a token outside the vocabulary, two
    prompts in one request, and a prompt + request_output_len past the build's max_seq_len
    (2048), each refused alone while the others are served. Before, nothing checked it."""
    import tritonclient.http as http

    client = http.InferenceServerClient(tiny["plain"].http_url.removeprefix("http://"))

    def ask(ids: list[list[int]], tokens: int = 3) -> Any:
        batch = np.array(ids, dtype=np.int32)
        inputs = []
        for name, value in (("input_ids", batch),
                            ("input_lengths", np.full((len(ids), 1), batch.shape[1], np.int32)),
                            ("request_output_len", np.full((len(ids), 1), tokens, np.int32))):  # fmt: skip
            item = http.InferInput(name, list(value.shape), "INT32")
            item.set_data_from_numpy(value)
            inputs.append(item)
        return client.infer("tensorrt_llm", inputs)

    with pytest.raises(Exception, match="token id 99999 is outside the vocabulary"):
        ask([[5, 99999]])
    with pytest.raises(Exception, match="one prompt per request"):
        ask([[5, 17], [42, 99]])
    with pytest.raises(Exception, match=r"prompt \(3 tokens\) \+ request_output_len \(2046\) "
                                        r"exceeds the build's max_seq_len 2048"):  # fmt: skip
        ask([[5, 17, 42]], 2046)
    ids = ask([[5, 17, 42]]).as_numpy("output_ids")
    assert ids.reshape(-1).tolist() == tiny["runtime"].greedy([5, 17, 42], 3, set())


def test_a_load_failure_is_named_in_one_line() -> None:
    from trt_builder.triton.server import load_failure

    log = ('E1201 model_lifecycle.cc:642] "failed to load \'tensorrt_llm\' version 1: Internal: '
           'KeyError: \\"checkpoint_dir\\"\\n\\nAt:\\n  /r/tensorrt_llm/1/model.py(9): initialize\\n"')  # fmt: skip
    assert (
        load_failure(log)
        == 'model tensorrt_llm failed to load: Internal: KeyError: "checkpoint_dir"'
    )
    assert load_failure("I1201 server.cc:1] all good") is None


def test_a_request_past_its_timeout_is_an_error_and_the_server_goes_on(
    tiny: dict[str, Any],
) -> None:
    """1000 tokens with no end id cannot come within 0.2 s: the client gives up with a one-line
    error (gRPC's deadline), and the next request is served."""
    late = TritonRuntime(tiny["plain"].grpc_url, timeout=0.2)
    with pytest.raises(TritonError, match="refused or timed out.*Deadline Exceeded"):
        late.greedy_batch([[5, 17, 42]], 1000, {-1})
    want = tiny["runtime"].greedy([5, 17, 42], 4, set())
    assert TritonRuntime(tiny["plain"].grpc_url).greedy_batch([[5, 17, 42]], 4, {-1}) == [want]


#: Eight different prompts, for requests that run together.
TEXTS = ["The quick brown fox", "Once upon a time", "The capital of France is", "List three colours",
         "How do plants make food", "Write about the sea", "A compiler is", "Water boils at"]  # fmt: skip


def test_32_concurrent_clients_each_get_the_answer_a_lone_request_gets(
    tiny: dict[str, Any],
) -> None:
    """32 at once over HTTP (the plain repository) and over gRPC streams (the streaming one):
    the in-flight batch gives each the answer it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from trt_builder.triton.client import Request, generate, stream

    http, grpc = tiny["plain"].http_url, tiny["streaming"].grpc_url

    def plain(text: str) -> str:
        return generate(http, Request(prompt=text, max_tokens=12))

    def streamed(text: str) -> str:
        return "".join(stream(grpc, Request(prompt=text, max_tokens=12)))

    texts = [TEXTS[i % len(TEXTS)] for i in range(32)]
    for ask in (plain, streamed):
        alone = {text: ask(text) for text in TEXTS}
        with ThreadPoolExecutor(32) as pool:
            together = list(pool.map(ask, texts))
        assert together == [alone[text] for text in texts], ask.__name__
        assert len(set(alone.values())) > 1  # the prompts are told apart


def test_in_a_plain_repository_a_short_request_finishes_while_a_long_one_runs(
    tiny: dict[str, Any],
) -> None:
    """In-flight batching without streaming: a request that arrives while a long one runs
    joins the batch and is answered before the long one ends; `streaming` is refused there,
    in the tensorrtllm backend's words."""
    import threading
    import time

    import tritonclient.http as http

    url = tiny["plain"].http_url.removeprefix("http://")
    done: dict[str, float] = {}

    def ask(name: str, tokens: int) -> None:
        client = http.InferenceServerClient(url, network_timeout=120)
        client.infer("tensorrt_llm", _ids_request(http, [5, 17, 42], tokens))
        done[name] = time.monotonic()

    # 1000 tokens of this tiny model took under 0.5 s on an idle 2-core host, so the long one
    # had ended before the short one was sent; 2000 take seconds (each step reads the whole cache)
    long = threading.Thread(target=ask, args=("long", 2000))
    long.start()
    time.sleep(0.2)  # the long request is running
    ask("short", 3)
    assert long.is_alive() and "long" not in done
    long.join()
    assert done["short"] < done["long"]
    client = http.InferenceServerClient(url)
    with pytest.raises(Exception, match="Streaming is only supported if model is deployed using"):
        client.infer("tensorrt_llm", _ids_request(http, [5, 17], 3, streaming=True))


def test_killing_the_server_mid_stream_is_a_clear_error_and_serve_starts_clean_after(
    tiny: dict[str, Any], tmp_path: Path
) -> None:
    """SIGKILL to tritonserver while a gRPC stream runs: the client's error says the stream
    broke off; Server.stop() then leaves no process of its group (the stubs exit when they
    notice their server is gone, unless one was waiting on the server's answer at that moment:
    then it hangs holding its interpreter's lock, as seen once here, and stop() kills it and
    names it); a new server on the same ports serves."""
    import os
    import signal

    import tritonclient.grpc as grpc

    from trt_builder.triton.client import stream_results

    repository, ports = tiny["streaming_repository"], _ports(tmp_path / "first.log")
    before = set(Path("/tmp").glob("python_env_*"))
    server = start(repository, **ports)
    client = grpc.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
    results = stream_results(client, "tensorrt_llm",
                             _ids_request(grpc, [5, 17, 42], 1000, streaming=True), timeout=30)  # fmt: skip
    next(results)  # the first token came
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    with pytest.raises(TritonError, match="broke off: the server stopped or restarted"):
        for _ in results:
            pass
    server.stop(grace=5)
    assert not server.group() and all("tensorrt_llm_0_0" in left for left in server.left), (
        server.left
    )
    for left in set(Path("/tmp").glob("python_env_*")) - before:  # the killed backend's (empty)
        left.rmdir()
    with start(repository, **{**ports, "log": tmp_path / "again.log"}) as again:
        want = tiny["runtime"].greedy([5, 17, 42], 6, {2})
        assert TritonRuntime(again.grpc_url).greedy_batch([[5, 17, 42]], 6, {2}) == [want]


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls"])
def test_streams_cancelled_mid_answer_stop_generating_and_sigterm_drains_in_seconds(
    tiny: dict[str, Any], tmp_path: Path, model: str
) -> None:
    """20 gRPC streams, each of 2000 tokens, cancelled by their clients after the first token
    (tritonclient's stop_stream(cancel_requests=True)): the reference backend drops them, so a
    request sent afterwards is answered at once and SIGTERM ends the server within 10 s,
    unkilled. Before, generation went on for the vanished clients and SIGTERM took 30 s and a
    SIGKILL. Sent to tensorrt_llm_bls, the cancellation reaches the tensorrt_llm request it
    made (by the backend's `stop` input: Triton 2.51 cannot cancel a BLS request)."""
    import threading
    import time

    import tritonclient.grpc as grpc

    server = start(tiny["streaming_repository"], **_ports(tmp_path / "server.log"))
    try:
        clients = []
        for _ in range(20):
            client = grpc.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
            first = threading.Event()
            client.start_stream(callback=lambda result, error, first=first: first.set())
            if model == "tensorrt_llm":
                inputs = _ids_request(grpc, [5, 17, 42], 2000, streaming=True)
            else:  # no end id the tiny model could sample: it runs all 2000 tokens
                inputs = _ensemble_inputs(grpc, 2000, True)
            client.async_stream_infer(model, inputs)
            clients.append((client, first))
        for client, first in clients:
            assert first.wait(60), "a stream's first token did not come"
            client.stop_stream(cancel_requests=True)
            client.close()
        started = time.monotonic()
        want = tiny["runtime"].greedy([5, 17, 42], 4, {2})
        assert TritonRuntime(server.grpc_url).greedy_batch([[5, 17, 42]], 4, {2}) == [want]
        answered = time.monotonic() - started
        started = time.monotonic()
        code = server.stop(grace=10)
        stopped = time.monotonic() - started
    finally:
        server.stop(grace=5)
    assert answered < 10, f"a new request waited {answered:.1f} s behind cancelled ones"
    assert not server.killed and code == 0 and stopped < 10, (code, stopped)


ASK = "The quick brown fox"
#: How every error for a request cut off by a death ends.
AGAIN = "this request was cut off; send it again"


def _ensemble_body(tokens: int, stream: bool) -> dict[str, Any]:
    """An ensemble request as clients send it, with no end id the model could sample: it runs
    all `tokens`."""
    return {"text_input": ASK, "max_tokens": tokens, "end_id": -1, "stream": stream}


def _ensemble_inputs(module: Any, tokens: int, stream: bool, prompt: str = ASK) -> list[Any]:
    """An ensemble request's inputs for tritonclient `module` (grpc or http), with no end id the
    model could sample: it runs all `tokens`."""
    from trt_builder.triton import client as triton_client

    inputs = triton_client._inputs(
        module, triton_client.Request(prompt=prompt, max_tokens=tokens), stream
    )
    return [*inputs, triton_client._tensor(module, "end_id", -1, "INT32")]


class _Call:
    """One request in a thread of its own, as a client makes it: `how` is "http" (generate),
    "http-stream" (generate_stream), "grpc" (a unary call), "grpc-stream" (a streamed answer
    over a gRPC stream), "grpc-stream-whole" (an unstreamed answer over a gRPC stream) or
    "direct" (a gRPC stream straight to tensorrt_llm); to `model` on the server at `ports`.
    `first` is set once the first piece came (for a whole answer: once the request was sent),
    and `leave` makes the client go away then (the connection closed, the stream cancelled).
    `outcome`: "error: <Triton's message>", "finished", "cut: <what broke>" or "left"."""

    def __init__(self, ports: dict[str, int], how: str, model: str = "ensemble", *,
                 tokens: int = 1000, leave: bool = False) -> None:  # fmt: skip
        import threading

        self.ports, self.how, self.model, self.tokens, self.leave = ports, how, model, tokens, leave
        self.first = threading.Event()
        self.outcome = ""
        self.ended = 0.0  # time.monotonic() when the outcome came
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcome = self._http() if self.how.startswith("http") else self._grpc()
        except Exception as exc:  # what a client library raises when the connection breaks
            self.outcome = f"cut: {type(exc).__name__}: {exc}"
        finally:
            self.ended = time.monotonic()
            self.first.set()

    def _http(self) -> str:
        import http.client

        stream = self.how == "http-stream"
        connection = http.client.HTTPConnection("127.0.0.1", self.ports["http_port"], timeout=120)
        path = f"/v2/models/{self.model}/generate" + ("_stream" if stream else "")
        body = json.dumps(_ensemble_body(self.tokens, stream))
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        if not stream:
            self.first.set()
        answer = connection.getresponse()
        if not stream:
            said = json.loads(answer.read() or b"{}")
            return f"error: {said['error']}" if "error" in said else "finished"
        while True:
            line = answer.fp.readline()  # not the lax line iterator: a cut body must show
            if not line:
                return "cut: the body ended without its last chunk"
            if line.startswith(b"data:"):
                said = json.loads(line[5:])
                if "error" in said:
                    return f"error: {said['error']}"
                self.first.set()
                if self.leave:
                    connection.close()
                    return "left"
            elif line.strip() == b"0":  # the chunked body's end
                return "finished"

    def _grpc(self) -> str:
        import queue

        import tritonclient.grpc as grpc

        client = grpc.InferenceServerClient(f"127.0.0.1:{self.ports['grpc_port']}")
        if self.how == "direct":
            inputs = _ids_request(grpc, [5, 17, 42], self.tokens, streaming=True)
        else:
            inputs = _ensemble_inputs(grpc, self.tokens, self.how == "grpc-stream")
        if self.how == "grpc":
            self.first.set()
            try:
                client.infer(self.model, inputs, client_timeout=120)
            except grpc.InferenceServerException as exc:
                return f"error: {exc.message()}"
            return "finished"
        came: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: came.put((result, error)))
        client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)
        if self.how == "grpc-stream-whole":
            self.first.set()
        try:
            while True:
                result, error = came.get(timeout=120)
                if error is not None:
                    status = str(getattr(error, "status", lambda: "")() or "")
                    broke = "Stream removed" in str(error) or "Socket closed" in str(error)
                    said = " ".join(part for part in (status, error.message()) if part)
                    return f"{'cut' if broke else 'error'}: {said}"
                self.first.set()
                if self.leave:
                    client.stop_stream(cancel_requests=True)
                    return "left"
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return "finished"
        finally:
            client.stop_stream()
            client.close()

    def join(self, seconds: float) -> str:
        self.thread.join(timeout=seconds)
        return self.outcome or "(still waiting)"


def _cpu_seconds(pid: int) -> float:
    """The user and system CPU time of process `pid` so far."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _computing_for(pid: int, since: float, limit: float = 30.0) -> float:
    """Seconds after `since` (a time.monotonic()) until process `pid` stops computing: until
    its CPU time grows less than 0.02 s in 0.2 s. AssertionError if it still computes after
    `limit` seconds."""
    before = _cpu_seconds(pid)
    while True:
        time.sleep(0.2)
        now = _cpu_seconds(pid)
        if now - before < 0.02:
            return time.monotonic() - since
        before = now
        assert time.monotonic() - since < limit, f"still computing {limit:g} s later"


class _Serve:
    """`trt-builder serve` of `repository` as an operator runs it: a subprocess on free ports,
    what it prints so far, and the processes of the tritonserver it runs now."""

    def __init__(self, repository: Path, tmp_path: Path) -> None:
        import os
        import subprocess
        import sys

        self.ports = {k: v for k, v in _ports(tmp_path / "unused.log").items() if k != "log"}
        self.url = f"http://127.0.0.1:{self.ports['http_port']}"
        self.said = tmp_path / "serve.err"
        argv = [sys.executable, "-m", "trt_builder.cli.main", "serve", str(repository),
                *(f"--{k.replace('_', '-')}={v}" for k, v in self.ports.items())]  # fmt: skip
        env = {**os.environ, "TMPDIR": str(tmp_path)}  # serve's server logs go there, not /tmp
        with open(self.said, "w") as out:
            self.process = subprocess.Popen(argv, stderr=out, stdin=subprocess.DEVNULL, env=env)

    @property
    def lines(self) -> list[str]:
        return self.said.read_text().splitlines()

    def ready(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def wait(self, condition: Any, seconds: float) -> float:
        """Seconds until `condition()`; fails if serve exits or `seconds` pass first."""
        import time

        start_at = time.monotonic()
        while not condition():
            assert time.monotonic() - start_at < seconds, self.lines
            assert self.process.poll() is None, (self.process.returncode, self.lines)
            time.sleep(0.2)
        return time.monotonic() - start_at

    def serving(self, times: int = 1) -> float:
        """Wait until serve has said it serves (`times` counts the restarts' lines too) and the
        server is ready."""
        said = lambda: sum(ln.startswith("serving") for ln in self.lines) >= times  # noqa: E731
        return self.wait(lambda: said() and self.ready(), 120)

    def stub(self) -> tuple[int, str]:
        """The pid of the current server's tensorrt_llm stub, and the server's shared-memory
        prefix (its regions are /dev/shm/<prefix>*)."""
        import os
        import re
        import subprocess

        def pids(pattern: str) -> list[int]:
            found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
            return [int(pid) for pid in found.stdout.split()]

        (triton,) = pids(f"bin/tritonserver .*--http-port={self.ports['http_port']}")
        mine = [pid for pid in pids("tensorrt_llm/[0-9]+/model.py") if os.getpgid(pid) == triton]
        assert len(mine) == 1, mine
        argv = Path(f"/proc/{triton}/cmdline").read_bytes().decode()
        shm = re.search(r"shm-region-prefix-name=(\w+?)0_", argv)
        assert shm and list(Path("/dev/shm").glob(f"{shm[1]}*")), argv
        return mine[0], shm[1]

    def triton(self) -> int:
        """The pid of the tritonserver serve runs now (its process group's too)."""
        import subprocess

        found = subprocess.run(["pgrep", "-f", f"bin/tritonserver .*--http-port={self.ports['http_port']}"],
                               capture_output=True, text=True).stdout.split()  # fmt: skip
        assert len(found) == 1, found
        return int(found[0])

    def group(self, pgid: int) -> list[str]:
        """The living processes of process group `pgid`, as `pid command line`."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                argv = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(f"{stat.parent.name} {argv.strip()}")
        return found

    def model_process(self) -> int:
        """The pid of the tensorrt_llm model's model process (the reference backend's)."""
        mine = [int(line.split()[0]) for line in self.group(self.triton())
                if "trt_builder.runtimes.model_process tensorrt_llm_0_0" in line]  # fmt: skip
        assert len(mine) == 1, mine
        return mine[0]

    def stop(self) -> int:
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def default_streaming(default_variant: Any) -> tuple[Any, Path]:
    """The README's int8 build of the default model packaged as a streaming repository (its
    stages up to package come from the build's cache): the build result, the repository."""
    result = default_variant(dtype="int8", **{"triton.streaming": True})
    return result, result.layout.triton


def _answers_as_the_runtime(result: Any, url: str) -> None:
    from transformers import AutoTokenizer

    end = {
        AutoTokenizer.from_pretrained(
            result.layout.triton / "preprocessing" / "tokenizer"
        ).eos_token_id
    }
    want = CheckpointRuntime.load(result.layout.checkpoint).greedy([5, 17, 42], 6, end)
    assert TritonRuntime(url).greedy_batch([[5, 17, 42]], 6, end) == [want]


def test_a_dead_model_process_ends_every_request_with_an_error_naming_it(
    default_streaming: tuple[Any, Path], tmp_path: Path
) -> None:
    """`trt-builder serve` of the default model's int8 streaming repository. SIGKILL to the
    tensorrt_llm model's model process with requests in flight on every protocol, through the
    ensemble (HTTP, HTTP stream, a streamed and a whole answer over gRPC streams) and straight
    to tensorrt_llm: each ends within 10 s with an error naming the process and the signal;
    serve says the death and its counted restart, readiness turns false, and the new server
    answers as the checkpoint runtime does. Then SIGKILL to the tensorrt_llm stub with gRPC
    streams through the ensemble, and at once SIGTERM to tritonserver (as serve sends when it
    sees the death before the BLS model does): each ends with an error naming the dead stub
    (before, they ended as empty successes; then, with the stopping server's silence taken for
    a reload's unloaded version, as connection errors); a stream straight to tensorrt_llm, which the Python backend never answers
    once its stub is dead, breaks off when the server is restarted. SIGTERM then exits 0."""
    import os
    import signal
    import time

    result, repository = default_streaming
    serve = _Serve(repository, tmp_path)
    try:
        serve.serving()
        ways = ["http", "http-stream", "grpc-stream", "grpc-stream-whole"]
        calls = [_Call(serve.ports, how) for how in ways] + [
            _Call(serve.ports, "direct", "tensorrt_llm")
        ]
        for call in calls:
            assert call.first.wait(60), (call.how, call.outcome)
        time.sleep(1.0)  # the whole answers' requests are in the batch
        worker = serve.model_process()
        os.kill(worker, signal.SIGKILL)
        # the signal where the model hears it; the death where the BLS model sees it
        died = f"model process tensorrt_llm_0_0 (PyTorch, pid {worker}) "
        outcomes = {call.how: call.join(10) for call in calls}
        assert outcomes.pop("direct") == f"error: {died}was killed by SIGKILL: {AGAIN}", outcomes
        assert all(o.startswith("error: ") and f"{died}died: {AGAIN}" in o
                   for o in outcomes.values()), outcomes  # fmt: skip
        serve.wait(lambda: not serve.ready(), 10)
        assert any("model process tensorrt_llm_0_0 (PyTorch) died: restarting tritonserver "
                   "(restart 1 of at most 3" in line for line in serve.lines), serve.lines  # fmt: skip
        serve.serving(times=2)
        _answers_as_the_runtime(result, f"grpc://127.0.0.1:{serve.ports['grpc_port']}")

        # gRPC only: an HTTP connection in flight would hold the server's stop (core's
        # "exiting", when it answers no readiness) until the BLS model had answered it
        streams = [_Call(serve.ports, "grpc-stream") for _ in range(2)]
        direct = _Call(serve.ports, "direct", "tensorrt_llm")
        for call in [*streams, direct]:
            assert call.first.wait(60), (call.how, call.outcome)
        stub, _ = serve.stub()
        os.kill(stub, signal.SIGKILL)
        os.kill(serve.triton(), signal.SIGTERM)  # as serve does when it sees the death first
        gone = f"model process tensorrt_llm_0_0 (Python-backend stub, pid {stub}) died: {AGAIN}"
        outcomes = [call.join(10) for call in streams]
        assert all(o.startswith("error: ") and gone in o for o in outcomes), outcomes
        assert direct.join(10).startswith("cut: "), direct.outcome
        serve.serving(times=3)
        assert any("restart 2 of at most 3" in line for line in serve.lines), serve.lines
        _answers_as_the_runtime(result, f"grpc://127.0.0.1:{serve.ports['grpc_port']}")
    finally:
        code = serve.stop()
    assert code == 0, serve.lines


def test_clients_that_leave_through_the_ensemble_stop_their_work_and_sigterm_exits_0(
    default_streaming: tuple[Any, Path], tmp_path: Path
) -> None:
    """`trt-builder serve` of the default model's int8 streaming repository. 10 clients of
    /v2/models/ensemble/generate_stream, each gone (its connection closed) after its first
    piece, then 10 gRPC streams to the ensemble, each cancelled after its first piece (1000
    tokens asked, no end id): each time the model process stops computing within 3 s of the
    last departure (before, it went on for 16 s), a new request is answered as the checkpoint
    runtime answers it, and SIGTERM then makes serve exit 0 within 10 s with no process of
    its server's group left (before: exit 12 after 10.5 s, two stubs left running)."""
    import time

    result, repository = default_streaming
    serve = _Serve(repository, tmp_path)
    try:
        serve.serving()
        group = serve.triton()
        worker = serve.model_process()
        for how in ("http-stream", "grpc-stream"):
            calls = [_Call(serve.ports, how, leave=True) for _ in range(10)]
            assert [call.join(120) for call in calls] == ["left"] * 10, [c.outcome for c in calls]
            stopped = _computing_for(worker, max(call.ended for call in calls))
            assert stopped < 3, f"{how}: the model process computed {stopped:.1f} s after they left"
            _answers_as_the_runtime(result, f"grpc://127.0.0.1:{serve.ports['grpc_port']}")
        asked = time.monotonic()
        code = serve.stop()
        took = time.monotonic() - asked
    finally:
        serve.stop()
    assert code == 0 and took < 10, (code, took, serve.lines)
    assert not serve.group(group), serve.group(group)
    assert not any("killed what" in line for line in serve.lines), serve.lines


def test_in_a_plain_repository_a_dead_model_process_fails_its_requests_and_the_next_is_answered(
    tiny: dict[str, Any],
) -> None:
    """A plain (not streaming) repository, Triton's own ensemble, no serve watching: SIGKILL
    to the tensorrt_llm model's model process with an HTTP and a gRPC request in flight
    through the ensemble; each ends within 10 s with the error naming the process and the
    signal, and the next request starts a new model process, which answers it rightly."""
    import os
    import signal
    import time

    from trt_builder.triton.client import Request, generate

    server = tiny["plain"]
    ports = {"http_port": server.http_port, "grpc_port": server.grpc_port}
    want = generate(server.http_url, Request(prompt=ASK, max_tokens=8))
    (worker,) = [pid for pid, name in server.model_processes().items()
                 if name == "tensorrt_llm_0_0 (PyTorch)"]  # fmt: skip
    calls = [_Call(ports, how, tokens=2000) for how in ("http", "grpc")]
    for call in calls:
        assert call.first.wait(60)
    time.sleep(1.0)  # both in the batch
    os.kill(worker, signal.SIGKILL)
    died = f"model process tensorrt_llm_0_0 (PyTorch, pid {worker}) was killed by SIGKILL: {AGAIN}"
    outcomes = [call.join(10) for call in calls]
    assert all(o.startswith("error: ") and died in o for o in outcomes), outcomes
    assert generate(server.http_url, Request(prompt=ASK, max_tokens=8)) == want
    assert worker not in server.model_processes()


def test_serve_gives_up_after_three_restarts_and_exits_12(
    tiny: dict[str, Any], tmp_path: Path
) -> None:
    """A model process that keeps dying: serve restarts the server three times, and on the
    fourth death says it gives up and exits 12 (for systemd or Kubernetes to take over),
    leaving no tritonserver and no shared-memory region behind."""
    import os
    import signal
    import subprocess

    from trt_builder.triton.server import MAX_RESTARTS

    serve = _Serve(tiny["streaming_repository"], tmp_path)
    prefixes = []
    try:
        for times in range(1, MAX_RESTARTS + 2):
            serve.serving(times)
            stub, shm = serve.stub()
            prefixes.append(shm)
            os.kill(stub, signal.SIGKILL)
        code = serve.process.wait(timeout=60)
    finally:
        serve.stop()
    assert code == 12, serve.lines
    assert "giving up" in serve.lines[-1] and "after 3 restarts" in serve.lines[-1], serve.lines
    assert sum("restarting tritonserver" in line for line in serve.lines) == MAX_RESTARTS
    left = subprocess.run(["pgrep", "-f", f"--http-port={serve.ports['http_port']}"],
                          capture_output=True, text=True).stdout  # fmt: skip
    assert not left and not [p for p in prefixes if list(Path("/dev/shm").glob(f"{p}*"))]


def test_a_new_version_is_loaded_while_requests_flow_and_none_fails(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`package` publishes version 2 of a served repository; Server.reload (what serve does when
    the link moves) loads it through Triton's model-control API while four clients keep asking:
    none fails, every answer is the right one, they are answered after it, and every model is
    then at version 2."""
    import threading
    import time
    import urllib.request

    from trt_builder.triton.client import Request, generate

    _, repository = _package(tiny_llama, tmp_path, dtype="float32")
    with start(repository, **_ports(tmp_path / "server.log")) as server:
        want = generate(server.http_url, Request(prompt="The quick brown fox", max_tokens=8))
        answers: list[str] = []
        failures: list[str] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                try:
                    answers.append(generate(server.http_url,
                                            Request(prompt="The quick brown fox", max_tokens=8)))  # fmt: skip
                except Exception as exc:
                    failures.append(str(exc))

        clients = [threading.Thread(target=client) for _ in range(4)]
        for c in clients:
            c.start()
        try:
            assert server.reload() is None  # nothing new yet
            deadline = time.monotonic() + 60  # requests flowing before the new version comes
            while not answers and time.monotonic() < deadline and not failures:
                time.sleep(0.1)
            _package(tiny_llama, tmp_path, dtype="float32",
                     **{"triton.kv_cache_free_gpu_mem_fraction": 0.8})  # fmt: skip
            before = len(answers)
            assert server.reload() == 2
            # requests that came during the load were held, not dropped (on 2 busy cores the
            # answers can pause for its length); the clients go on being answered after it
            after, deadline = len(answers), time.monotonic() + 60
            while len(answers) < after + 4 and time.monotonic() < deadline and not failures:
                time.sleep(0.1)
            served = len(answers)
        finally:
            stop.set()
            for c in clients:
                c.join()
        index = urllib.request.Request(f"{server.http_url}/v2/repository/index", data=b"{}")
        with urllib.request.urlopen(index) as answer:
            ready = {(m["name"], m["version"]) for m in json.loads(answer.read())
                     if m.get("state") == "READY"}  # fmt: skip
    assert not failures, failures[:3]
    assert before > 0 and served >= after + 4 and set(answers) == {want}
    assert ready == {
        (m, "2") for m in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")
    }


def test_in_a_plain_repository_a_grpc_deadline_through_the_ensemble_stops_its_work(
    tiny: dict[str, Any],
) -> None:
    """A plain repository's ensemble (the BLS model, one response per request): a gRPC call
    whose 0.5 s deadline passes early in an answer that takes seconds whole (timed first, on
    this machine): the model process stops computing well before the rest of the answer would
    have taken (Triton's ensemble scheduler told the running step nothing: it ran to the end).
    An HTTP client of /generate that closes its connection is not seen: docs/triton.md."""
    import tritonclient.grpc as grpc

    server = tiny["plain"]
    (worker,) = [pid for pid, name in server.model_processes().items()
                 if name == "tensorrt_llm_0_0 (PyTorch)"]  # fmt: skip
    client = grpc.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
    inputs = _ensemble_inputs(grpc, 2000, False)
    started = time.monotonic()
    client.infer("ensemble", inputs, client_timeout=120)  # the whole answer
    whole = time.monotonic() - started
    with pytest.raises(grpc.InferenceServerException, match="Deadline"):
        client.infer("ensemble", inputs, client_timeout=0.5)
    stopped = _computing_for(worker, time.monotonic())
    client.close()
    assert whole > 1.5 and stopped < (whole - 0.5) * 0.6, (whole, stopped)


def test_serve_loads_a_new_version_without_taking_its_old_processes_for_deaths(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Under `trt-builder serve`, `package` publishes version 2: serve says it loaded it, the
    old version's stubs and model process exit as it unloads, and serve does not take that for
    a death (no restart), then answers with version 2 and exits 0 on SIGTERM."""
    from trt_builder.triton.client import Request, generate

    _, repository = _package(tiny_llama, tmp_path / "build", dtype="float32")
    serve = _Serve(repository, tmp_path)
    try:
        serve.serving()
        old = serve.model_process()
        _package(tiny_llama, tmp_path / "build", dtype="float32",
                 **{"triton.kv_cache_free_gpu_mem_fraction": 0.8})  # fmt: skip
        serve.wait(lambda: any("version 2 of" in line for line in serve.lines), 120)
        serve.wait(lambda: not Path(f"/proc/{old}").exists(), 30)  # the old one unloaded
        time.sleep(2.5)  # two more looks by serve
        assert not any("restart" in line for line in serve.lines), serve.lines
        assert generate(serve.url, Request(prompt=ASK, max_tokens=4))
    finally:
        code = serve.stop()
    assert code == 0, serve.lines
