"""bench: aiperf against a real tritonserver serving the reference backend; the figures, the
page, the comparison; and the bad input refused before any load, with nothing written."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from trt_builder.bench.compare import compare, verdict
from trt_builder.bench.figures import summarize
from trt_builder.bench.loadgen import find_aiperf, parse
from trt_builder.bench.options import BenchOptions
from trt_builder.bench.prompts import read_jsonl
from trt_builder.cli.main import main
from trt_builder.core.errors import InputError, SpecError

DATA = Path(__file__).parent / "data" / "aiperf"


def _aiperf() -> bool:
    try:
        find_aiperf()
    except InputError:
        return False
    return True


needs_aiperf = pytest.mark.skipif(
    not _aiperf(), reason="needs aiperf (bash scripts/setup.sh --bench)"
)


def test_aiperfs_export_becomes_the_figures() -> None:
    """A real export (aiperf 0.13 against the reference backend, concurrency 2, 12 requests)."""
    f = parse(DATA / "profile_export_aiperf.json")
    raw = json.loads((DATA / "profile_export_aiperf.json").read_text())
    assert f["ttft_ms"]["p50"] == raw["time_to_first_token"]["p50"]
    assert f["itl_ms"]["p99"] == raw["inter_token_latency"]["p99"]
    assert f["e2e_ms"]["p90"] == raw["request_latency"]["p90"]
    assert f["requests"] == 12 and f["errors"] == 0
    assert f["ttft_ms"]["p50"] < f["e2e_ms"]["p50"]
    assert f["output_token_throughput"] == pytest.approx(16.7368, abs=1e-3)


def test_a_summary_has_the_spread_of_its_repeats_and_a_comparison_judges_by_it() -> None:
    f = parse(DATA / "profile_export_aiperf.json")
    runs = [{**f, "output_token_throughput": t} for t in (16.0, 16.5, 17.0)]
    s = summarize(runs)["output_token_throughput"]
    assert s["mean"] == pytest.approx(16.5) and s["std"] == pytest.approx(0.5)
    assert (s["min"], s["max"], s["n"]) == (16.0, 17.0, 3)
    faster = summarize([{**f, "output_token_throughput": t} for t in (20.0, 20.4, 19.6)])
    close = summarize([{**f, "output_token_throughput": t} for t in (16.3, 16.9, 16.6)])
    key = "output_token_throughput"
    assert verdict(summarize(runs)[key], faster[key], +1) == "better"
    assert verdict(faster[key], summarize(runs)[key], +1) == "worse"
    assert verdict(summarize(runs)[key], close[key], +1) == "within noise"
    one = summarize(runs[:1])[key]
    assert verdict(one, summarize(runs[1:2])[key], +1).startswith("unknown")
    a = {"points": [{"mode": "concurrency", "load": 1.0, "summary": summarize(runs)}]}
    b = {"points": [{"mode": "concurrency", "load": 1.0, "summary": faster},
                    {"mode": "concurrency", "load": 2.0, "summary": faster}]}  # fmt: skip
    rows = {r["metric"]: r for r in compare(a, b)}
    assert rows[key]["ratio"] == pytest.approx(20.0 / 16.5) and rows[key]["verdict"] == "better"
    assert {r["load"] for r in compare(a, b)} == {1.0}  # only the points both ran


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration": 0.0}, "--duration must be above 0"),
        ({"concurrency": (0,)}, "--concurrency values must be 1 or more"),
        ({"rates": (-1.0,)}, "--rate values must be above 0"),
        ({"concurrency": ()}, "nothing to run"),
        ({"prompts": "prompts.txt"}, "use bundled, synthetic or a .jsonl file"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        BenchOptions(**kwargs)


def test_ignore_eos_sends_the_end_id_no_token_is(tmp_path: Path) -> None:
    """--ignore-eos: every request's payload carries end_id -1 (aiperf merges extra inputs into
    the template's payload), TensorRT-LLM's own ignore_eos value; without it, no end_id is sent
    and the deployment's end token ends an answer."""
    from trt_builder.bench.loadgen import Aiperf, command

    def argv(**kw: Any) -> list[str]:
        return command(Aiperf("aiperf", "0.13.0"), BenchOptions(prompts="synthetic", **kw),
                       "concurrency", 1.0, url="http://h:8000", tokenizer=tmp_path, prompts=None,
                       out=tmp_path, seed=0)  # fmt: skip

    extra = [argv(ignore_eos=True)[i + 1] for i, a in enumerate(argv(ignore_eos=True))
             if a == "--extra-inputs"]  # fmt: skip
    assert "end_id:-1" in extra and not any("end_id" in a for a in argv())
    with pytest.raises(SpecError, match="ignore_eos must be true or false"):
        BenchOptions(ignore_eos="yes")  # type: ignore[arg-type]


def test_a_jsonl_line_without_text_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "Hello", "output_length": 4}\n\n{"prompt": "no text here"}\n')
    with pytest.raises(
        InputError,
        match=r'p.jsonl line 3 has no text: each line must be a JSON object with a "text"',
    ):
        read_jsonl(path)
    path.write_text('{"text": "Hello", "output_length": 0}\n')
    with pytest.raises(InputError, match="line 1: output_length must be a whole number above 0"):
        read_jsonl(path)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@needs_aiperf
def test_bad_targets_get_one_line_and_leave_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(["bench", f"http://127.0.0.1:{_closed_port()}", "--tokenizer", str(tmp_path),
                 "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 12 and "cannot reach http://127.0.0.1:" in err and "trt-builder serve" in err
    assert "Traceback" not in err
    code = main(["bench", "grpc://127.0.0.1:8001", "--out", str(out)])
    assert code == 3 and "give the server's HTTP address" in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text('{"txt": "x"}\n')
    code = main(["bench", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)])
    assert code == 3 and "p.jsonl line 1 has no text" in capsys.readouterr().err
    code = main(["bench", str(tmp_path), "--duration", "0", "--out", str(out)])
    assert code == 2 and "--duration must be above 0" in capsys.readouterr().err
    assert not out.exists() and not out.with_suffix(".html").exists()


@pytest.fixture(scope="module")
def repositories(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny Llama packaged streaming (what bench drives) and plain (what it refuses)."""
    from trt_builder.pipeline import run
    from trt_builder.spec.build import make_spec

    root = tmp_path_factory.mktemp("bench")
    out: dict[str, Path] = {}
    for name, streaming in (("streaming", True), ("plain", False)):
        spec = make_spec(model=str(tiny_llama), dtype="float32", out=root / name / "e",
                         triton_root=root / name / "t",
                         **{"verify.heldout_tokens": 128, "triton.streaming": streaming})  # fmt: skip
        out[name] = run(spec).layout.triton
    return out


@pytest.mark.integration
@needs_aiperf
def test_a_sweep_against_a_served_repository(
    repositories: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The repository served for the run by a real tritonserver, closed-loop points and an
    open-loop (Poisson) one: every request of every point answered and counted, first tokens
    before the ends, the page drawn; then the same result against itself, point by point."""
    import tempfile

    before = set(Path(tempfile.gettempdir()).iterdir())
    out = tmp_path / "r.json"
    code = main(["bench", str(repositories["streaming"]), "--concurrency", "1,2", "--rate", "4",
                 "--requests", "4", "--warmup", "1", "--output-tokens", "8", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    result = json.loads(out.read_text())
    assert [(p["mode"], p["load"]) for p in result["points"]] == [
        ("concurrency", 1.0),
        ("concurrency", 2.0),
        ("rate", 4.0),
    ]
    for point in result["points"]:
        (run,) = point["repeats"]
        assert run["requests"] == 4 and run["errors"] + len(run["ttft_samples_ms"]) == 4
        # the tiny random model may end an answer after its first token (no inter-token gap)
        assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
        assert run["itl_ms"]["p50"] >= 0 and run["output_token_throughput"] > 0
    page = out.with_suffix(".html").read_text()
    assert page.count("<svg") == 2 and "concurrency 2" in page and "rate 4" in page
    assert result["tools"]["aiperf"] == "0.13.0" and result["url"].startswith("http://127.0.0.1:")
    assert result["options"]["model"] == "tensorrt_llm_bls"  # the whole-text model, unasked
    ours = ("trt-builder-bench-", "aiperf", "tritonserver-")  # what a bench would leave there
    new = set(Path(tempfile.gettempdir()).iterdir()) - before
    left = [p for p in new if p.name.startswith(ours) or (p / "aiperf").exists()]
    assert not left, sorted(left)[:5]  # aiperf's and the server's files went with the run
    code = main(["bench", "--compare", str(out), str(out), "--out", str(tmp_path / "c.json")])
    assert code == 0
    both = json.loads((tmp_path / "c.json").read_text())
    assert {r["ratio"] for r in both["comparison"] if r["ratio"] is not None} == {1.0}


@pytest.mark.integration
@needs_aiperf
def test_a_repository_that_cannot_stream_or_load_is_refused(
    repositories: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(["bench", str(repositories["plain"]), "--out", str(out)])
    assert code == 8 and "[triton] streaming = true" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(repositories["streaming"].resolve(), broken)
    for f in broken.glob("tensorrt_llm/*/checkpoint/rank0.safetensors"):
        f.write_bytes(b"not safetensors")
    code = main(["bench", str(broken), "--requests", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 12 and "tensorrt_llm" in err and "Traceback" not in err
    assert not out.exists() and not out.with_suffix(".html").exists()
    log = out.with_suffix(".tritonserver.log")  # where the error points: kept, not deleted
    assert f"(log: {log})" in " ".join(err.split()) and "failed to load" in log.read_text()


@pytest.mark.integration
@needs_aiperf
def test_an_llmapi_repository_is_benched_each_answer_counted_once(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The llmapi model streams the whole text so far in every response, which aiperf adds up.
    One prompt, four requests: bench's output tokens are four times the tokens of the answer
    our own gRPC client gets for the same rendered chat, where aiperf counted more; its
    inter-token latency is the mean of aiperf's own gaps between responses; --ignore-eos,
    which the llmapi model has no input for, is refused in one line."""
    import tempfile

    from test_serve import _ports
    from transformers import AutoTokenizer

    from trt_builder.bench.cumulative import recount, token_counter
    from trt_builder.bench.loadgen import command, run_point
    from trt_builder.bench.prompts import write_prompts
    from trt_builder.pipeline import run
    from trt_builder.spec.build import make_spec
    from trt_builder.triton import client
    from trt_builder.triton.server import start

    spec = make_spec(model=str(tiny_llama), target="llmapi", dtype="float16",
                     out=tmp_path / "e", triton_root=tmp_path / "t",
                     **{"verify.heldout_tokens": 128, "triton.streaming": True})  # fmt: skip
    repo = run(spec).layout.triton
    checkpoint = next(repo.glob("tensorrt_llm/*/checkpoint"))
    (tmp_path / "one.jsonl").write_text('{"text": "The answer is"}\n')
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "The answer is"}],
                                             tokenize=False, add_generation_prompt=True)  # fmt: skip
    out = tmp_path / "r.json"
    with start(repo, **_ports(tmp_path / "server.log")) as server:
        request = client.Request(prompt=rendered, max_tokens=8)
        pieces = [p for p in client.stream(server.grpc_url, request) if p]  # what each added
        tokens = len(tokenizer.encode("".join(pieces), add_special_tokens=False))
        first = len(tokenizer.encode(pieces[0], add_special_tokens=False))
        flags = ["--tokenizer", str(checkpoint), "--concurrency", "2", "--requests", "4",
                 "--warmup", "1", "--prompts", str(tmp_path / "one.jsonl"),
                 "--output-tokens", "8", "--out", str(out)]  # fmt: skip
        code = main(["bench", server.http_url, *flags, "--ignore-eos"])
        err = capsys.readouterr().err
        assert code == 3 and "--ignore-eos: the llmapi model" in err and len(err.splitlines()) == 1
        assert not out.exists()
        code = main(["bench", server.http_url, *flags])
        assert code == 0, capsys.readouterr().err[-2000:]
        result = json.loads(out.read_text())
        assert result["serving"]["contract"] == "llmapi"
        assert result["options"]["model"] == "tensorrt_llm"
        (figures,) = result["points"][0]["repeats"]
        assert tokens > 1 and figures["requests"] == 4 and figures["errors"] == 0
        assert figures["output_tokens"] == 4 * tokens
        assert figures["aiperf_output_tokens"] > figures["output_tokens"]
        page = out.with_suffix(".html").read_text()  # the page says so, with both counts
        assert f"{4 * tokens} output tokens counted once (aiperf added up" in " ".join(page.split())

        options = BenchOptions(concurrency=(2,), requests=4, warmup=1, output_tokens=8,
                               prompts=str(tmp_path / "one.jsonl"), model="tensorrt_llm")  # fmt: skip
        prompts = write_prompts(options, tmp_path, chat=checkpoint)
        # a short path, as bench's own: aiperf's ZMQ sockets live under it (107 bytes at most)
        point = Path(tempfile.mkdtemp(prefix="trt-builder-bench-"))
        argv = command(find_aiperf(), options, "concurrency", 2, url=server.http_url,
                       tokenizer=checkpoint, prompts=prompts, out=point, seed=0, llmapi=True)  # fmt: skip
        figures = run_point(argv, point, tmp_path / "aiperf.log")
    decode = []  # each request's time from its first response to its last, by aiperf's gaps
    for line in (point / "profile_export.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["metadata"]["benchmark_phase"] != "warmup":
            chunks = row["metrics"]["inter_chunk_latency"]["value"]
            assert len(chunks) == len(pieces) - 1  # the responses our client got, one a step
            decode.append(sum(chunks))
    recount(figures, point, token_counter(checkpoint))
    shutil.rmtree(point)
    # the tokens after the first response's, once each (the random model's text encodes to
    # more tokens than it generated: tokens are counted on text, as aiperf counts them)
    want = sum(decode) / len(decode) / (tokens - first)
    assert figures["itl_ms"]["avg"] == pytest.approx(want, rel=1e-4)


def _bench_fleet(
    tmp_path: Path, model: Path, bench: str, streaming: str = "true", target: str = "engine"
) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(f"""[fleet]
name = "bench"
out = "engines"
triton_root = "triton"

[[models]]
id = "tiny"
model = "{model}"

[[models.variants]]
name = "f32"
dtype = "float32"
target = "{target}"
verify = {{ heldout_tokens = 128 }}
triton = {{ streaming = {streaming} }}
bench = {bench}
""")
    return path


def test_a_fleet_bench_is_checked_when_the_file_is_read(tiny_llama: Path, tmp_path: Path) -> None:
    from trt_builder.fleet.file import load_fleet

    entry = load_fleet(
        _bench_fleet(tmp_path, tiny_llama, "{ concurrency = [1, 2], requests = 3 }")
    ).entries[0]
    assert entry.bench == BenchOptions(concurrency=(1, 2), requests=3)
    names = [m.name for m in entry.metrics]
    assert "bench.concurrency2.output_token_throughput" in names and "top1" in names
    with pytest.raises(SpecError, match=r"bench: --duration must be above 0"):
        load_fleet(_bench_fleet(tmp_path, tiny_llama, "{ duration = 0 }"))
    with pytest.raises(SpecError, match=r"set \[triton\] streaming = true"):
        load_fleet(_bench_fleet(tmp_path, tiny_llama, "{ requests = 3 }", streaming="false"))
    with pytest.raises(SpecError, match=r"unknown key\(s\) concurency"):
        load_fleet(_bench_fleet(tmp_path, tiny_llama, "{ concurency = [1] }"))


@pytest.mark.integration
@needs_aiperf
@pytest.mark.parametrize("target", ["engine", "llmapi"])
def test_a_throughput_drop_fails_the_night_and_names_the_metric(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    """The first night benches the repository and records its figures; the history is then
    made to say the last good night was a hundred times as fast (the injected drop: a short bench
    on a shared CPU ran at least 2.7 times faster on its second night in CI, so a threefold drop
    was not enough). The second night's build is cached (convert and verify) and its quality
    figures equal the baseline's, but its throughput is about a hundredth: exit 11, naming the
    metric, the old value and the new one. Both targets' repositories."""
    # four requests a night: the other timings of so short a bench may move past their
    # tolerances too; the test is that the injected figure fails the night and is named
    fleet = _bench_fleet(tmp_path, tiny_llama,
                         "{ concurrency = [1], requests = 4, warmup = 1, output_tokens = 8 }",
                         target=target)  # fmt: skip
    code = main(["nightly", str(fleet), "--report-dir", str(tmp_path / "r1"), "--json"])
    first = json.loads(capsys.readouterr().out)
    assert code == 0, first
    (entry,) = first["entries"]
    tok_s = entry["metrics"]["bench.concurrency1.output_token_throughput"]
    assert tok_s > 0 and entry["metrics"]["bench.concurrency1.errors"] == 0
    assert Path(entry["paths"]["bench_report"]).is_file()
    history_file = tmp_path / "engines" / ".trt-builder" / "nightly-bench.json"
    history = json.loads(history_file.read_text())
    recorded = history["runs"][-1]["entries"]["tiny/f32"]["metrics"]
    assert recorded["bench.concurrency1.output_token_throughput"] == tok_s
    injected = 100 * tok_s
    recorded["bench.concurrency1.output_token_throughput"] = injected  # the injected drop
    history_file.write_text(json.dumps(history))

    code = main(["nightly", str(fleet), "--report-dir", str(tmp_path / "r2"), "--json"])
    out, err = capsys.readouterr()
    second = json.loads(out)
    (entry,) = second["entries"]
    assert code == 11 and entry["status"] == "regressed", entry["message"]
    regressed = [r["metric"] for r in entry["regressions"]]
    assert "bench.concurrency1.output_token_throughput" in regressed
    assert all(m.startswith("bench.") for m in regressed)  # no quality figure among them
    (message,) = [m for m in entry["regression_messages"] if "output_token_throughput" in m]
    assert "(output tokens/s at concurrency 1) regressed from" in message
    assert f"regressed from {injected:.2f} to " in message
    for name in ("top1", "kl_mean", "ppl_delta_pct", "greedy_agreement"):  # quality stays green
        assert entry["metrics"][name] == recorded[name]
    assert entry["stages"]["convert"] == entry["stages"]["verify"] == "cached"
    # the CI summary's load table: the regressed figure in bold with the old one, and what
    # served it (a PyTorch reference here, said so)
    md = (tmp_path / "r2" / "nightly.md").read_text()
    (row,) = [line for line in md.splitlines() if line.startswith("| `tiny/f32` | served by")]
    assert "a PyTorch reference, not TensorRT-LLM | concurrency 1 |" in row
    assert f"(was {injected:.2f})" in row.split(" | ")[3]


def test_a_point_that_never_ends_is_killed_with_its_workers(tmp_path: Path) -> None:
    """A load generator that hangs (a wedged server) is ended after the point's timeout, with
    the workers it started, and the run says so in one line naming its kept log."""
    import subprocess
    import sys
    import time

    from trt_builder.bench.loadgen import run_point
    from trt_builder.core.errors import TritonError

    pid_file = tmp_path / "worker.pid"
    hang = (f"import subprocess, time; w = subprocess.Popen(['sleep', '300']); "
            f"open({str(pid_file)!r}, 'w').write(str(w.pid)); time.sleep(300)")  # fmt: skip
    keep = tmp_path / "r.aiperf.log"
    started = time.monotonic()
    with pytest.raises(TritonError, match=r"did not finish this point within 2 s.*r\.aiperf\.log"):
        run_point([sys.executable, "-c", hang], tmp_path / "point", keep, timeout=2)
    assert time.monotonic() - started < 20 and keep.is_file()
    worker = int(pid_file.read_text())
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(worker)], capture_output=True, text=True)
    # gone, or dead and not yet reaped (Z, with ps's modifiers after it: ZN under nice)
    assert state.stdout.strip()[:1] in ("", "Z"), state.stdout
