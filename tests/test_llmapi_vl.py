"""--target llmapi on Qwen2.5-VL (the seed's Cosmos-Reason1-7B): the whole model, as TensorRT-LLM's
PyTorch backend serves it. The language model as for any family (quantized per the mode), the
vision tower copied unquantized under the hub's names, exclude_modules covering it; the Triton
repository declares main's image_url input; the reference backend answers text and refuses
images in one line (docs/llmapi.md)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trt_builder.calibrate.stats import calibrate, load_stats
from trt_builder.checkpoint.reader import read_checkpoint
from trt_builder.convert.model import convert_model
from trt_builder.modes import FloatMode, Fp8, QuantMode
from trt_builder.spec.build import CalibrationOptions
from trt_builder.targets.llmapi.checkpoint.loaders import CONTRACTS, check_unified
from trt_builder.targets.llmapi.convert import convert_llmapi

pytestmark = pytest.mark.integration
E4M3 = torch.float8_e4m3fn
TRANSFORMERS4 = Path(sys.prefix) / "transformers4"
EXCLUDED = ["lm_head", "model.embed_tokens", "visual*", "visual"]
IDS = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny Qwen2.5-VL as transformers 5 saves it (hub names: visual.*, model.layers.*),
    with the image processor's preprocessor_config.json beside it, as the hub's has."""
    from transformers import Qwen2VLImageProcessor

    from tiny_models import make_tiny

    path = tmp_path_factory.mktemp("vl") / "tiny-qwen2.5-vl"
    make_tiny("qwen2.5-vl", path, tokenizer_dir)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vl_calibration(tiny_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's calibration. transformers 5 runs a hub-layout Qwen2.5-VL's
    `model.layers.*` as `model.language_model.layers.*`: the statistics are under the file's
    names, which convert looks them up by."""
    out = tmp_path_factory.mktemp("vl-calibration")
    calibrate(tiny_vl, out, CalibrationOptions(samples=4, seq_len=32))
    weights = set(load_file(tiny_vl / "model.safetensors"))
    names = {k.rsplit(".", 1)[0] for k in load_stats(out)}  # what convert reads
    assert names and all(f"{n}.weight" in weights for n in names), sorted(names)[:3]
    assert any(n.startswith("model.layers.0.self_attn.") for n in names)
    modules = {k.rsplit(".", 1)[0] for k in load_stats(out, modules=True)}  # what runs it
    assert len(modules) == len(names) and all(
        m.startswith("model.language_model.") for m in modules
    )
    return out


def _llmapi(hf: Path, out: Path, mode: QuantMode, calibration: Path | None) -> dict[str, Any]:
    out.mkdir(parents=True)
    return convert_llmapi(mode, hf, out, calibration=calibration, recipe=None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t


PROBE = """
import json, sys, torch, transformers
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration
model = Qwen2_5_VLForConditionalGeneration.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
logits = model(input_ids=torch.tensor([json.loads(sys.argv[2])])).logits[0]
state = model.state_dict()
tower = {k: state[k].double().sum().item() for k in state if ".visual." in k or k.startswith("visual.")}
image = AutoImageProcessor.from_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps({"version": transformers.__version__, "logits": logits.tolist(), "tower": tower,
                  "image_processor": type(image).__name__}))
"""


def _probe(directory: Path, transformers4: bool) -> dict[str, Any]:
    """The checkpoint loaded by transformers 5 (this host's) or 4.57.1 (TensorRT-LLM 1.2's), in
    a child process: logits of IDS, the vision tower's tensor sums, its image processor."""
    env = dict(os.environ)
    if transformers4:
        assert (TRANSFORMERS4 / "transformers").is_dir(), "run scripts/setup.sh"
        env["PYTHONPATH"] = str(TRANSFORMERS4)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(directory), json.dumps(IDS)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_float16_checkpoint_is_the_whole_model_transformers_4_and_5_run(
    tiny_vl: Path, tmp_path: Path
) -> None:
    """Every source tensor under its own (hub) name, the vision tower the source's in float16;
    transformers 5 and 4.57.1 load it as Qwen2_5_VLForConditionalGeneration (the whole config,
    the M-RoPE section where 4.57 reads it) and its image processor, and run the source's text
    logits; the language model reads back as the engine target's checkpoint."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = tmp_path / "llmapi"
    summary = _llmapi(tiny_vl, out, FloatMode("float16"), None)
    assert {"preprocessor_config.json", "chat_template.jinja", "tokenizer.json"} <= set(
        summary["files"]
    )
    assert summary["loaders"] == sorted(CONTRACTS)
    assert any("the whole model is written" in n for n in summary["notes"])
    assert not any("only the language model is converted" in n for n in summary["notes"])
    source, written = load_file(tiny_vl / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(written) == sorted(source)
    tower = [n for n in source if n.startswith("visual.")]
    assert len(tower) == 18  # the 1-block tower: blocks.0, merger, patch_embed
    for name in tower:
        assert written[name].dtype == torch.float16
        assert torch.equal(written[name], source[name].half()), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["vision_config"]["depth"] == 1 and "quantization_config" not in config
    assert config["text_config"]["torch_dtype"] == config["torch_dtype"] == "float16"
    for contract in CONTRACTS.values():
        assert check_unified(out, contract) == [], contract.loader
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl, dtype=torch.float32)
    want = ref(input_ids=torch.tensor([IDS])).logits[0]
    new, old = _probe(out, transformers4=False), _probe(out, transformers4=True)
    assert old["version"] == "4.57.1" and new["version"] != old["version"]
    for got in (new, old):
        logits = torch.tensor(got["logits"])
        assert torch.allclose(logits, want, atol=2e-2), (
            got["version"],
            (logits - want).abs().max(),
        )
        assert (logits.argmax(-1) == want.argmax(-1)).all()
        assert got["image_processor"].startswith("Qwen2VLImageProcessor")
        assert len(got["tower"]) == len(tower)
        assert sorted(got["tower"].values()) == pytest.approx(
            sorted(source[n].half().double().sum().item() for n in tower)
        )
    assert torch.allclose(torch.tensor(new["logits"]), torch.tensor(old["logits"]), atol=1e-5)
    engine = tmp_path / "engine"
    engine.mkdir()
    convert_model(FloatMode("float16"), tiny_vl, engine, tp=1, pp=1, calibration=None)
    (_, tensors), (_, want_tensors) = read_checkpoint(out), read_checkpoint(engine)
    assert sorted(tensors) == sorted(want_tensors)  # the language model alone
    assert all(torch.equal(tensors[k], want_tensors[k]) for k in want_tensors)


def test_autoprocessor_loads_where_torchvision_is(tiny_vl: Path, tmp_path: Path) -> None:
    """LLM() builds Qwen2.5-VL's AutoProcessor from the checkpoint at start; transformers' needs
    torchvision for the video processor (TensorRT-LLM's containers have it; this host may not)."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    out = tmp_path / "llmapi"
    _llmapi(tiny_vl, out, FloatMode("float16"), None)
    assert type(AutoProcessor.from_pretrained(out)).__name__ == "Qwen2_5_VLProcessor"


def test_a_model_without_processor_files_is_built_and_said(tiny_vl: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    shutil.copytree(tiny_vl, hf)
    (hf / "preprocessor_config.json").unlink()
    summary = _llmapi(hf, tmp_path / "llmapi", FloatMode("float16"), None)
    assert "preprocessor_config.json" not in summary["files"]
    assert any("no preprocessor_config.json" in n and "processor files" in n
               for n in summary["notes"])  # fmt: skip


def test_fp8_names_exclusions_and_what_each_loader_reads(
    tiny_vl: Path, vl_calibration: Path, tmp_path: Path
) -> None:
    """FP8: the language model's linears e4m3 with their scales, the tower float16 and the
    source's, exclude_modules modelopt's plus the plain `visual` in both files (config.json's
    under exclude_modules too, the key vLLM 0.10-0.11 read); TensorRT-LLM 1.2 and vLLM load it,
    1.0 and 1.1 cannot on Hopper (the build says so); the language model reads back as the
    engine target's checkpoint, bit for bit. Each thing the loaders need, broken, is caught."""
    out = tmp_path / "llmapi"
    summary = _llmapi(tiny_vl, out, Fp8(search=False), vl_calibration)
    assert summary["loaders"] == ["tensorrt-llm 1.2", "vllm 0.10-0.34"]
    assert "tensorrt-llm 1.0, tensorrt-llm 1.1 fail on Hopper" in summary["notes"][-1]
    assert "#8569" in summary["notes"][-1] and "loads in tensorrt-llm 1.2" in summary["notes"][-1]
    table = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert table == {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": EXCLUDED}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == qc["exclude_modules"] == EXCLUDED and qc["quant_method"] == "modelopt"
    source, w = load_file(tiny_vl / "model.safetensors"), load_file(out / "model.safetensors")
    assert w["model.layers.0.self_attn.q_proj.weight"].dtype == E4M3
    assert w["model.layers.1.mlp.down_proj.input_scale"].shape == ()
    tower = sorted(n for n in w if n.startswith("visual."))
    assert tower == sorted(n for n in source if n.startswith("visual."))
    assert all(torch.equal(w[n], source[n].half()) for n in tower)
    problems = {c.loader: check_unified(out, c) for c in CONTRACTS.values()}
    assert problems["tensorrt-llm 1.2"] == problems["vllm 0.10-0.34"] == []
    for old in ("tensorrt-llm 1.0", "tensorrt-llm 1.1"):
        assert len(problems[old]) == 1 and "#8569" in problems[old][0], problems[old]
    engine = tmp_path / "engine"
    engine.mkdir()
    convert_model(Fp8(search=False), tiny_vl, engine, tp=1, pp=1, calibration=vl_calibration)
    (_, tensors), (_, want) = read_checkpoint(out), read_checkpoint(engine)
    assert sorted(tensors) == sorted(want)
    assert all(torch.equal(_bits(tensors[k]), _bits(want[k])) for k in want)

    def broken(edit: Any) -> dict[str, list[str]]:
        case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        shutil.copytree(out, case)
        edit(case)
        return {c.loader: check_unified(case, c) for c in CONTRACTS.values()}

    def transformers_layout(case: Path) -> None:  # 4.52-4.57's names for the tower
        t = load_file(case / "model.safetensors")
        save_file({("model." + k if k.startswith("visual.") else k): v for k, v in t.items()},
                  str(case / "model.safetensors"))  # fmt: skip

    def no_plain_visual(case: Path) -> None:  # modelopt 0.47's list alone
        config = json.loads((case / "config.json").read_text())
        config["quantization_config"]["exclude_modules"] = EXCLUDED[:3]
        (case / "config.json").write_text(json.dumps(config))

    def quantized_tower(case: Path) -> None:
        t = load_file(case / "model.safetensors")
        t["visual.blocks.0.attn.qkv.weight_scale"] = torch.ones(())
        save_file(t, str(case / "model.safetensors"))

    found = broken(transformers_layout)["tensorrt-llm 1.2"]
    assert found and all("go under visual." in p for p in found)
    found = broken(no_plain_visual)
    assert (
        found["tensorrt-llm 1.2"] == [] and "does not list 'visual'" in found["vllm 0.10-0.34"][0]
    )
    found = broken(quantized_tower)
    assert all(any("attn.qkv.weight_scale is quantized" in p for p in v) for v in found.values())


# -- built through the pipeline, served by the real tritonserver -------------------------------

OPEN_GATE = {"verify.min_top1": 0.0, "verify.max_kl": 1e6, "verify.max_ppl_delta_pct": 1e6,
             "verify.heldout_tokens": 64}  # fmt: skip
TEXT = "The answer is"
IMAGE = "https://example.com/cat.png"  # never fetched: the reference backend refuses it first


@pytest.fixture(scope="module")
def served(tiny_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny Qwen2.5-VL built --target llmapi --dtype fp8 (the seed's mode; calibrated,
    its rounding searched), packaged plain and streaming, each served; the checkpoint runtime's greedy
    answer to TEXT."""
    from test_serve import _ports
    from transformers import AutoTokenizer

    from trt_builder.pipeline import run
    from trt_builder.runtimes.checkpoint import CheckpointRuntime
    from trt_builder.spec.build import make_spec
    from trt_builder.triton.server import start

    root = tmp_path_factory.mktemp("vl-served")
    spec = {"model": str(tiny_vl), "target": "llmapi", "dtype": "fp8", "calibrate.samples": 8, "calibrate.seq_len": 64, "out": root / "engines",
            **OPEN_GATE}  # fmt: skip
    plain = run(make_spec(**spec, triton_root=root / "a"))
    stream = run(make_spec(**spec, triton_root=root / "b", **{"triton.streaming": True}))
    checkpoint = plain.layout.checkpoint
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(TEXT).input_ids
    new = CheckpointRuntime.load(checkpoint).greedy(ids, 8, {2})
    with (
        start(plain.layout.triton, **_ports(root / "a.log")) as a,
        start(stream.layout.triton, **_ports(root / "b.log")) as b,
    ):
        yield {"plain": a, "streaming": b, "build": plain,
               "want": tokenizer.decode(new, skip_special_tokens=True)}  # fmt: skip


def test_the_build_declares_image_url_and_validates(served: dict[str, Any], tmp_path: Path) -> None:
    import yaml

    from trt_builder.core.errors import PackageError
    from trt_builder.targets.llmapi.triton import LLMAPI_IN, MODEL, validate_llmapi

    build = served["build"]
    stages = {r.name: r.status for r in build.records}
    assert stages["verify"] == "ran" and stages["package"] == "ran"
    notes = " ".join(build.notices)
    assert "the whole model is written" in notes and "only the language model" not in notes
    repo = tmp_path / "repo"
    shutil.copytree(build.layout.triton.resolve(), repo)
    config = validate_llmapi(repo)
    inputs = {t.name: t for t in config.input}
    assert len(inputs) == len(LLMAPI_IN) + 1
    image = inputs["image_url"]
    assert (image.data_type, list(image.dims), image.optional) == (13, [-1], True)  # TYPE_STRING
    settings = yaml.safe_load((repo / MODEL / "1" / "model.yaml").read_text())
    assert settings["triton_config"] == {"max_batch_size": 0, "decoupled": False,
                                         "multimodal": True}  # fmt: skip
    assert (repo / MODEL / "1" / "checkpoint" / "preprocessor_config.json").is_file()
    # the seed's mode through the whole pipeline: the language model e4m3, the tower float16
    checkpoint = repo / MODEL / "1" / "checkpoint"
    quant = json.loads((checkpoint / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8" and quant["exclude_modules"] == EXCLUDED
    weights = load_file(checkpoint / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == E4M3
    tower = [v.dtype for k, v in weights.items() if k.startswith("visual.")]
    assert tower and set(tower) == {torch.float16}
    pbtxt = repo / MODEL / "config.pbtxt"
    text = pbtxt.read_text()
    start = text.index('input {\n  name: "image_url"')
    pbtxt.write_text(text[:start] + text[text.index("}\n", start) + 2 :])
    with pytest.raises(PackageError, match="input image_url is None"):
        validate_llmapi(repo)


def _inputs(module: Any, text: str, image: str | None, **extra: Any) -> list[Any]:
    values = {"text_input": (np.array([text], dtype=object), "BYTES"),
              "sampling_param_max_tokens": (np.array([8], np.int32), "INT32"),
              **({"image_url": (np.array([image], dtype=object), "BYTES")} if image else {}),
              **extra}  # fmt: skip
    out = []
    for name, (value, dtype) in values.items():
        item = module.InferInput(name, list(value.shape), dtype)
        item.set_data_from_numpy(value)
        out.append(item)
    return out


def test_the_reference_backend_answers_text_and_refuses_an_image(served: dict[str, Any]) -> None:
    """Text: the checkpoint runtime's answer, over HTTP and gRPC, streamed too. An image: one
    line that says why, on the template's error path, streamed or not; the server goes on."""
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    from trt_builder.triton import client
    from trt_builder.triton.python_models.llmapi import NO_IMAGES

    want = served["want"]
    for url in (served["plain"].http_url, served["plain"].grpc_url):
        assert client.generate(url, client.Request(prompt=TEXT, max_tokens=8)) == want, url
    pieces = client.stream(served["streaming"].grpc_url, client.Request(prompt=TEXT, max_tokens=8))
    assert "".join(pieces) == want
    assert "\n" not in NO_IMAGES and "language model only" in NO_IMAGES
    g = grpc.InferenceServerClient(served["plain"].grpc_url.split("://")[1])
    with pytest.raises(Exception, match="runs the language model only") as info:
        g.infer("tensorrt_llm", _inputs(grpc, TEXT, IMAGE))
    assert NO_IMAGES in str(info.value) and "\n" not in str(info.value)
    h = http.InferenceServerClient(served["plain"].http_url.split("://")[1])
    with pytest.raises(Exception, match="runs the language model only"):
        h.infer("tensorrt_llm", _inputs(http, TEXT, IMAGE))
    s = grpc.InferenceServerClient(served["streaming"].grpc_url.split("://")[1])
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    s.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        stream = {"streaming": (np.array([True]), "BOOL")}
        s.async_stream_infer("tensorrt_llm", _inputs(grpc, TEXT, IMAGE, **stream))
        result, error = results.get(timeout=60)
    finally:
        s.stop_stream()
    assert result is None and NO_IMAGES in str(error)
    for server in (served["plain"], served["streaming"]):
        assert server.process.poll() is None  # the server goes on
    assert (
        client.generate(served["plain"].grpc_url, client.Request(prompt=TEXT, max_tokens=8)) == want
    )


def test_infer_sends_an_image_and_says_why_it_is_refused(
    served: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """`trt-builder infer --image`: the reference backend's refusal as one line, exit 12 (a
    Triton request refused), streamed or not; to the engine target's ensemble, exit 3 before
    anything is sent."""
    from trt_builder.cli.main import main

    for url, stream in (
        (served["plain"].http_url, []),
        (served["streaming"].grpc_url, ["--stream"]),
    ):
        code = main(["infer", "--url", url, "--prompt", TEXT, "--image", IMAGE, *stream])
        out, err = capsys.readouterr()
        assert code == 12, err
        assert "runs the language model only" in err and len(err.strip().splitlines()) == 1
        assert "Traceback" not in err and out.strip() == ""
    from trt_builder.triton.client import Request, _inputs

    with pytest.raises(Exception, match="--image: the engine target's ensemble takes text only"):
        _inputs(None, Request(prompt=TEXT, image=IMAGE), False)
