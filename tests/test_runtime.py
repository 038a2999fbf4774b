"""The checkpoint runtime executes TensorRT-LLM checkpoints like transformers runs the HF model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import FAMILIES, make_tiny
from trt_builder.convert.floats import convert_checkpoint
from trt_builder.modes import FloatMode, WeightOnlyInt8
from trt_builder.runtimes.checkpoint import CheckpointRuntime, KVCache

pytestmark = pytest.mark.integration

IDS = torch.tensor([5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21])


def _logits(hf_dir: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def _run(hf_dir: Path, tmp: Path, mode: object) -> CheckpointRuntime:
    tmp.mkdir(parents=True, exist_ok=True)
    convert_checkpoint(hf_dir, tmp, mode)  # type: ignore[arg-type]
    return CheckpointRuntime.load(tmp)


def test_float32_matches_transformers(tiny_llama: Path, tmp_path: Path) -> None:
    got = _run(tiny_llama, tmp_path, FloatMode("float32")).forward(IDS)
    torch.testing.assert_close(got, _logits(tiny_llama), atol=1e-4, rtol=1e-4)


def test_float16_close_to_transformers(tiny_llama: Path, tmp_path: Path) -> None:
    ref = _logits(tiny_llama)
    got = _run(tiny_llama, tmp_path, FloatMode("float16")).forward(IDS)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_llama3_rope_scaling_matches_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    from tiny_models import make_tiny_llama

    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8, "rope_theta": 50000.0}  # fmt: skip
    make_tiny_llama(tmp_path / "m", tokenizer_dir, rope_parameters=rope)
    got = _run(tmp_path / "m", tmp_path / "ck", FloatMode("float32")).forward(IDS)
    torch.testing.assert_close(got, _logits(tmp_path / "m"), atol=1e-4, rtol=1e-4)


def test_w8a16_executes_per_channel_int8_weights(tiny_llama: Path, tmp_path: Path) -> None:
    model = _run(tiny_llama, tmp_path, WeightOnlyInt8(clip=False))  # the builder's rounding
    w = model.w["transformer.layers.0.mlp.fc.weight"]
    used = model._dense["transformer.layers.0.mlp.fc.weight"]
    scale = (w.float().abs().amax(1, keepdim=True) / 128).half().float()
    q = used / scale
    assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 128
    assert not torch.equal(used, w.float())  # the weight really was rounded to INT8
    # Embeddings, norms and lm_head stay in the model dtype.
    assert torch.equal(model._dense["lm_head.weight"], model.w["lm_head.weight"].float())
    # round to nearest on the amax/128 grid: within half a step, but the row's largest
    # positive value, which lands on 128 and is clamped to 127 (a whole step)
    err = (used - w.float()).abs()
    top = q >= 127
    assert bool((err[~top] <= scale.expand_as(err)[~top] / 2 + 1e-6).all())
    assert bool((err[top] <= scale.expand_as(err)[top] + 1e-6).all())
    assert int(q.round().max()) == 127 and int(q.round().min()) >= -128
    ref = _logits(tiny_llama)
    assert (model.forward(IDS).argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_kv_cache_decoding_matches_full_forward(tiny_llama: Path, tmp_path: Path) -> None:
    model = _run(tiny_llama, tmp_path, FloatMode("float32"))
    full = model.forward(IDS)
    cache = KVCache()
    steps = [model.forward(IDS[:5], cache)[-1]] + [
        model.forward(IDS[i : i + 1], cache)[-1] for i in range(5, len(IDS))
    ]
    torch.testing.assert_close(torch.stack(steps), full[4:], atol=1e-5, rtol=1e-5)


def test_greedy_matches_transformers_generate(tiny_llama: Path, tmp_path: Path) -> None:
    model = _run(tiny_llama, tmp_path, FloatMode("float32"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = IDS[:6]
    out = hf.generate(
        prompt[None],
        attention_mask=torch.ones(1, 6, dtype=torch.long),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert model.greedy(prompt.tolist(), 8, set()) == out[0, 6:].tolist()


def test_a_left_padded_batch_matches_each_sequence_alone(tiny_llama: Path, tmp_path: Path) -> None:
    model = _run(tiny_llama, tmp_path, FloatMode("float32"))  # float16 rounds batch sums apart
    prompts = [IDS.tolist(), IDS[:4].tolist(), IDS[3:10].tolist()]
    width = len(IDS)
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    pad = torch.tensor([width - len(p) for p in prompts])
    logits = model.forward(batch, pad=pad)
    for row, prompt in enumerate(prompts):
        alone = model.forward(torch.tensor(prompt))
        torch.testing.assert_close(logits[row, int(pad[row]) :], alone, atol=1e-4, rtol=1e-4)
    stop = {int(model.forward(IDS[:4]).argmax(-1)[-1])}  # the second prompt stops at once
    batched = model.greedy_batch(prompts, 6, stop)
    assert batched == [model.greedy(p, 6, stop) for p in prompts]
    assert len(batched[1]) == 1 and len(batched[0]) == 6


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_runtime_agrees_with_cpu_and_passes_verify(
    tokenizer_dir: Path, tmp_path: Path, family: str
) -> None:
    """float32, so that CPU and GPU must agree closely (float16 gates on random tiny models
    would measure near-ties in their logits, not the device)."""
    from trt_builder.modes import DEFAULT_GATES
    from trt_builder.verify.compare import verify_checkpoint

    make_tiny(family, tmp_path / "m", tokenizer_dir)
    (tmp_path / "ck").mkdir()
    convert_checkpoint(tmp_path / "m", tmp_path / "ck", FloatMode("float32"), tp=2)
    cpu = CheckpointRuntime.load(tmp_path / "ck").forward(IDS)
    cuda = CheckpointRuntime.load(tmp_path / "ck", device="cuda").forward(IDS).cpu()
    torch.testing.assert_close(cuda, cpu, atol=1e-3, rtol=1e-3)
    report = verify_checkpoint(
        tmp_path / "ck", tmp_path / "m", gate=DEFAULT_GATES["float32"], device="cuda"
    )
    assert report["device"] == "cuda" and report["passed"], report["failures"]
