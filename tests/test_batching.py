"""In-flight batching over the checkpoint runtime (runtimes/batching.py): the same greedy
answers as the runtime's own generation, requests joining and leaving mid-run, TensorRT-LLM's
sampling parameters, and the stops."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from trt_builder.convert.floats import convert_checkpoint
from trt_builder.core.errors import InputError
from trt_builder.modes import FloatMode, Fp8, SmoothQuant
from trt_builder.runtimes.batching import InflightBatcher, Request, Sampling, generate, sample
from trt_builder.runtimes.checkpoint import CheckpointRuntime

pytestmark = pytest.mark.integration

PROMPTS = [[5, 17, 42], [99, 7, 250, 3, 64, 128, 11], [300], [21, 8, 90, 33, 2, 40]]


@pytest.fixture(scope="module")
def runtime(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> CheckpointRuntime:
    ck = tmp_path_factory.mktemp("ck")
    convert_checkpoint(tiny_llama, ck, FloatMode("float32"))
    return CheckpointRuntime.load(ck)


def test_greedy_answers_equal_the_runtimes_own_generation(runtime: CheckpointRuntime) -> None:
    """Four prompts of different lengths, at most two at a time: the others wait and join as
    places free up; each answer equals the runtime's greedy continuation of that prompt alone."""
    lengths = [12, 3, 8, 5]
    requests = [Request(tuple(p), n) for p, n in zip(PROMPTS, lengths, strict=True)]
    got = generate(runtime, requests, max_batch_size=2)
    want = [runtime.greedy(p, n, set()) for p, n in zip(PROMPTS, lengths, strict=True)]
    assert got == want and [len(g) for g in got] == lengths


def test_requests_join_and_leave_at_every_step(runtime: CheckpointRuntime) -> None:
    """A long request does not hold up short ones: they finish while it runs, and one submitted
    mid-run joins at the next step, all in fewer steps than one after another."""
    batcher = InflightBatcher(runtime, max_batch_size=4)
    long = batcher.submit(Request(tuple(PROMPTS[1]), 16))
    short = [batcher.submit(Request(tuple(p), 3)) for p in (PROMPTS[0], PROMPTS[2])]
    steps, finished, late = 0, [], None
    while not batcher.idle:
        events = batcher.step()
        steps += 1
        assert len(events) <= 4
        finished += [e.request for e in events if e.finished]
        if steps == 5:
            late = batcher.submit(Request(tuple(PROMPTS[3]), 4))
        if late is not None and steps == 6:
            assert late in {e.request for e in events}  # it joined the running batch
    assert finished == [*short, late, long]
    # four prefill steps (each with its request's first token), then the long request's other
    # 15 tokens: 19 steps, where one request after another takes a step per token, 26
    assert steps == 4 + 15 < 16 + 3 + 3 + 4


def test_sampling_follows_the_request_and_its_seed(runtime: CheckpointRuntime) -> None:
    prompt = tuple(PROMPTS[1])

    def run(sampling: Sampling) -> list[int]:
        return generate(runtime, [Request(prompt, 12, sampling=sampling)])[0]

    greedy = runtime.greedy(list(prompt), 12, set())
    assert run(Sampling()) == greedy and run(Sampling(top_k=1, temperature=0.7)) == greedy
    hot = Sampling(top_k=50, temperature=5.0, seed=7)
    assert run(hot) == run(hot)  # the seed decides
    assert len({tuple(run(Sampling(top_k=50, temperature=5.0, seed=s))) for s in range(4)}) > 1
    # top-p keeps the smallest set of tokens whose mass reaches p: a tiny p is greedy
    assert run(Sampling(top_p=1e-6, temperature=5.0, seed=3)) == greedy


def test_sample_draws_only_from_the_top_k_and_the_top_p_mass() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, -1.0])
    seen = set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        seen.add(sample(logits, Sampling(top_k=2, temperature=10.0), g))
    assert seen == {1, 2}
    probs = torch.softmax(logits.double(), -1)  # 0.03, 0.64, 0.24, 0.09, 0.01
    assert float(probs[1] + probs[2]) > 0.85 > float(probs[1])
    seen = set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        seen.add(sample(logits, Sampling(top_p=0.85), g))
    assert seen == {1, 2}


def test_end_ids_stop_words_and_bad_words(runtime: CheckpointRuntime) -> None:
    prompt = tuple(PROMPTS[1])
    greedy = runtime.greedy(list(prompt), 10, set())
    end = greedy[3]
    assert (
        generate(runtime, [Request(prompt, 10, end_id=end)])[0] == greedy[: greedy.index(end) + 1]
    )
    stop = tuple(greedy[4:6])
    stopped = generate(runtime, [Request(prompt, 10, stop_words=(stop,))])[0]
    assert stopped[-2:] == list(stop) and len(stopped) <= 6
    banned = generate(runtime, [Request(prompt, 10, bad_words=((greedy[0],),))])[0]
    assert banned[0] != greedy[0] and greedy[0] not in banned


def test_bad_requests_are_refused_by_name() -> None:
    with pytest.raises(InputError, match="the prompt has no tokens"):
        Request((), 4)
    with pytest.raises(InputError, match="max_new_tokens must be at least 1"):
        Request((1, 2), 0)
    # the engine target's values as its C++ executor refuses them (samplingConfig.cpp)
    with pytest.raises(InputError, match=r"^Assertion failed: temperature.value\(\) >= 0.f$"):
        Sampling(temperature=-0.5)
    with pytest.raises(InputError, match=r"^Assertion failed: topP.value\(\) <= 1.f$"):
        Sampling(top_p=1.5)
    with pytest.raises(InputError, match=r"^Assertion failed: topK.value\(\) >= 0$"):
        Sampling(top_k=-1)


def test_temperature_zero_is_greedy_on_both_targets_and_the_llm_apis_values_mean_its_own() -> None:
    """Temperature 0 is greedy where TensorRT-LLM takes it so: its executor scales the logits
    by 1 / (0 + 1e-6), and the LLM API's SamplingParams (1.2+) calls it greedy, as its own
    example does; a value the LLM API refuses is refused in its words."""
    from trt_builder.runtimes.requests import llmapi_sampling

    logits = torch.tensor([0.0, 3.0, 2.9, 2.0, -1.0])
    generator = torch.Generator().manual_seed(0)
    hot = Sampling(top_k=4, temperature=0.0)
    assert hot.greedy and {sample(logits, hot, generator) for _ in range(50)} == {1}
    assert not Sampling(top_k=4, temperature=1.0).greedy
    assert llmapi_sampling().greedy and llmapi_sampling(temperature=0.0).greedy
    assert llmapi_sampling(top_p=0.0, temperature=0.8).greedy and llmapi_sampling(top_k=1).greedy
    # the others' unset values: temperature 1, every token, top-p 1 (no cut)
    sampled = llmapi_sampling(temperature=0.7)
    assert not sampled.greedy and (sampled.top_k, sampled.top_p) == (0, 1.0)
    assert llmapi_sampling(top_k=5) == Sampling(top_k=5, top_p=1.0, temperature=1.0)
    for value, message in [({"temperature": -1.0}, "require temperature >= 0, got temperature=-1.0"),
                           ({"top_k": -2}, "require top_k >= 0, got top_k=-2"),
                           ({"top_p": 1.5}, "require 0 <= top_p <= 1, got top_p=1.5")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            llmapi_sampling(**value)


def test_top_k_one_is_greedy_whatever_top_p_says_and_top_k_keeps_exactly_k() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, 2.0, 2.0, -1.0])
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        assert sample(logits, Sampling(top_k=1, top_p=0.9, temperature=3.0), g) == 1
    seen = set()
    for seed in range(300):  # three tokens tie at the second place: two are kept, not four
        g = torch.Generator().manual_seed(seed)
        seen.add(sample(logits, Sampling(top_k=2, temperature=10.0), g))
    assert len(seen) == 2 and 1 in seen


@pytest.mark.gpu
def test_the_batcher_runs_on_cuda_as_on_the_cpu(tiny_llama: Path, tmp_path: Path) -> None:
    """Caches, pads and the sampling generator where the runtime is: the same tokens, greedy
    and seeded, as on the CPU."""
    ck = tmp_path / "ck"
    ck.mkdir()
    convert_checkpoint(tiny_llama, ck, FloatMode("float32"))
    requests = [Request(tuple(p), 6) for p in PROMPTS]
    requests.append(
        Request(tuple(PROMPTS[0]), 6, sampling=Sampling(top_k=20, temperature=2.0, seed=5))
    )
    cpu = generate(CheckpointRuntime.load(ck), requests, max_batch_size=3)
    assert generate(CheckpointRuntime.load(ck, "cuda"), requests, max_batch_size=3) == cpu


#: 36 prompts of 1 to 24 tokens: more than DECODE_ROWS, so decoding spans several row blocks.
MIXED = [[(7 * i + 13 * j) % 300 + 3 for j in range(1 + (5 * i) % 24)] for i in range(36)]


@pytest.fixture(scope="module")
def wide_llama(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers of SmolLM2-135M's width (hidden 576, 9 heads of 64, 3 KV heads): reductions
    that wide choose their kernels by shape where hidden 64 does not (seen on the H200)."""
    from tiny_models import make_tiny_llama

    path = tmp_path_factory.mktemp("wide-llama")
    make_tiny_llama(path, tokenizer_dir, hidden_size=576, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # fmt: skip
    return path


@pytest.mark.parametrize(
    "mode",
    [FloatMode("float16"), FloatMode("bfloat16"), SmoothQuant(alpha=0.5),
     SmoothQuant(alpha=0.5, per_token=False, kv_cache="int8"), Fp8(kv_cache="fp8", search=False)],
    ids=["float16", "bfloat16", "int8-sq", "int8-sq-tensor-kv8", "fp8-fp8kv"],
)  # fmt: skip
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_request_decodes_bit_for_bit_as_alone_whatever_shares_its_step(
    mode: object, device: str, wide_llama: Path, tmp_path: Path
) -> None:
    """36 prompts of mixed lengths decoded together for 6 steps: every row's logits equal, bit
    for bit, what the same prompt gets decoded alone; and the batcher's greedy answers, 36 at
    a time, equal each request's answer alone. Before, the batch's caches were left-padded and
    stacked into one forward: its GEMMs' shape and its attention's padded reductions changed
    the last bits, which int8 rounding made another token (11 of 48 answers on the default
    model)."""
    from trt_builder.calibrate.stats import calibrate
    from trt_builder.convert.model import convert_model
    from trt_builder.runtimes.checkpoint import KVCache
    from trt_builder.spec.build import CalibrationOptions

    calibration = None
    if mode.needs_calibration:  # type: ignore[attr-defined]
        calibration = tmp_path / "calibration"
        calibration.mkdir()
        calibrate(wide_llama, calibration, CalibrationOptions(samples=8, seq_len=64))
    ck = tmp_path / "ck"
    ck.mkdir()
    convert_model(mode, wide_llama, ck, tp=1, pp=1, calibration=calibration)  # type: ignore[arg-type]
    runtime = CheckpointRuntime.load(ck, device)

    def prefilled(prompts: list[list[int]]) -> tuple[list[KVCache], list[int]]:
        caches = [KVCache() for _ in prompts]
        firsts = [int(runtime.forward(torch.tensor(p), c, last=True)[-1].argmax())
                  for p, c in zip(prompts, caches, strict=True)]  # fmt: skip
        return caches, firsts

    together, tokens = prefilled(MIXED)
    alone = [prefilled([p]) for p in MIXED]
    for _ in range(6):
        batch = runtime.decode(tokens, together)
        for row, (caches, token) in enumerate(alone):
            single = runtime.decode(token, caches)
            assert torch.equal(batch[row], single[0]), (row, (batch[row] - single[0]).abs().max())
            token[0] = int(single[0].argmax())
        tokens = batch.argmax(-1).tolist()
    requests = [Request(tuple(p), 8) for p in MIXED]
    assert generate(runtime, requests, max_batch_size=36) == [
        generate(runtime, [r], max_batch_size=1)[0] for r in requests
    ]


def test_a_failing_prefill_fails_its_request_alone(runtime: CheckpointRuntime) -> None:
    """A request whose forward raises (here: one the runtime cannot embed, its token past the
    vocabulary) is dropped with StepFailed naming it; the requests running and waiting go on
    and get their answers alone. Before, the reference backend failed every request."""
    from trt_builder.runtimes.batching import StepFailed

    batcher = InflightBatcher(runtime, max_batch_size=4)
    good = [batcher.submit(Request(tuple(p), 5)) for p in PROMPTS[:2]]
    bad = batcher.submit(Request((5, 10**6), 5))
    late = batcher.submit(Request(tuple(PROMPTS[2]), 5))
    out: dict[int, list[int]] = {rid: [] for rid in (*good, late)}
    failed = []
    while not batcher.idle:
        try:
            for event in batcher.step():
                out[event.request].append(event.token)
        except StepFailed as exc:
            failed += exc.requests
    assert failed == [bad]
    want = [runtime.greedy(p, 5, set()) for p in PROMPTS[:3]]
    assert [out[good[0]], out[good[1]], out[late]] == want


def test_a_model_process_that_dies_fails_its_requests_by_name_and_starts_again(
    runtime: CheckpointRuntime, tiny_llama: Path, tmp_path: Path
) -> None:
    """The reference backend's model process (runtimes/model_process.py) answers as the batch
    does in this process; SIGKILL mid-answer: step() raises ProcessDied for both requests it
    held, naming the instance, the pid and the signal, with Triton's UNAVAILABLE; the next
    submit starts a new process, which answers as before; close() leaves no process."""
    import os
    import signal

    from trt_builder.runtimes.model_process import ModelProcess
    from trt_builder.runtimes.requests import ProcessDied

    def answer(process: ModelProcess, rid: int) -> list[int]:
        tokens: list[int] = []
        while rid in process.outstanding:
            tokens += [e.token for e in process.step() if e.request == rid]
        return tokens

    (tmp_path / "ck").mkdir()
    convert_checkpoint(tiny_llama, tmp_path / "ck", FloatMode("float32"))  # the runtime's
    process = ModelProcess("tensorrt_llm_0_0", tmp_path / "ck", "cpu", 4)
    try:
        assert process.vocab_size == runtime.config["vocab_size"] and process.device == "cpu"
        want = runtime.greedy(PROMPTS[0], 6, set())
        assert answer(process, process.submit(Request(tuple(PROMPTS[0]), 6))) == want
        held = [process.submit(Request(tuple(p), 2000)) for p in PROMPTS[1:3]]
        while not process.step():  # both running
            pass
        first = process.pid
        os.kill(first, signal.SIGKILL)
        with pytest.raises(ProcessDied) as died:
            for _ in range(100):
                process.step()
        assert sorted(died.value.requests) == held and died.value.code == "UNAVAILABLE"
        assert str(died.value) == (f"model process tensorrt_llm_0_0 (PyTorch, pid {first}) was killed "
                                   "by SIGKILL: this request was cut off; send it again")  # fmt: skip
        again = process.submit(Request(tuple(PROMPTS[0]), 6))
        assert process.pid != first and answer(process, again) == want
    finally:
        last = process.pid
        process.close()
    assert not Path(f"/proc/{last}").exists()
