"""JUnit XML and HTML renderings of the verify report (no models: report dicts built here)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html import escape
from pathlib import Path
from typing import Any

import pytest

from trt_builder.verify.reports import write_html, write_junit, write_reports

SCRIPT = "<script>alert(1)</script>"
SVG_NAMESPACES = ("http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink")
FAILURES = [
    "top-1 agreement 0.9000 < 0.99",
    "mean KL 2.10e-02 > 1e-03",
    "held-out perplexity +3.20% > +1.0%",
    "end-of-sequence ids: the output ends at once: 1 prompt(s) end on their first token, "
    f"e.g. '{SCRIPT}'; end ids [2] come from the tokenizer and generation_config.json",
    "MLP fc and gate swapped in layer 1: mlp.fc holds the weights of mlp.gate",
]
DIAGNOSIS = [
    {
        "cause": "rotary settings (rotary_base / rotary_scaling) or the position embedding",
        "evidence": "the error grows with position: mean KL 1.00e-06 at positions 0-1, "
        "3.00e-02 from position 8 on",
        "fatal": False,
    },
    {
        "cause": "MLP fc and gate swapped in layer 1",
        "evidence": "mlp.fc holds the weights of mlp.gate & <the other way round>",
        "fatal": True,
    },
]


def _prompt(text: str, top1: float, reference: str, candidate: str) -> dict[str, Any]:
    return {
        "prompt": text,
        "tokens": 40,
        "top1": top1,
        "kl_mean": 1e-5,
        "max_abs_logit_error": 0.03,
        "greedy_match_tokens": 16 if reference == candidate else 3,
        "greedy_tokens": 16,
        "reference_text": reference,
        "candidate_text": candidate,
        "candidate_empty": candidate == "",
    }


def passing_report() -> dict[str, Any]:
    return {
        "passed": True,
        "failures": [],
        "diagnosis": [],
        "gate": {"min_top1": 0.99, "max_kl": 0.001, "max_ppl_delta_pct": 1.0, "min_greedy": None},
        "runtime": "reference",
        "device": "cpu",
        "checkpoint": "/abs/checkpoint",
        "reference": "/abs/hf",
        "reference_dtype": "float32",
        "checkpoint_dtype": "float16",
        "quant_algo": None,
        "seconds": 12.3,
        "top1": 0.998,
        "kl_mean": 1.5e-5,
        "max_abs_logit_error": 0.05,
        "greedy_agreement": 1.0,
        "tokens": 120,
        "perplexity": {"reference": 12.1, "candidate": 12.11, "delta_pct": 0.08, "tokens": 2048},
        "prompts": [
            _prompt("The capital of France is", 1.0, " Paris.", " Paris."),
            _prompt("Count: 1, 2, 3,", 0.995, " 4, 5, 6", " 4, 5, 6"),
            _prompt(f"Explain {SCRIPT} & $x$", 1.0, " It is <b>HTML</b>.", " It is <b>HTML</b>."),
        ],
        "by_layer": [
            {"layer": 0, "rel_error": 1e-4},
            {"layer": 1, "rel_error": 2e-4},
            {"layer": 2, "rel_error": 3e-4, "final": True},
        ],
        "by_position": [
            {"position": i, "kl_mean": 1e-6 * (i + 1), "top1": 1.0, "count": 3} for i in range(12)
        ],
    }


def failing_report() -> dict[str, Any]:
    report = passing_report()
    report.update(
        passed=False,
        failures=list(FAILURES),
        diagnosis=copy.deepcopy(DIAGNOSIS),
        top1=0.9,
        kl_mean=2.1e-2,
        perplexity={"reference": 12.1, "candidate": 12.5, "delta_pct": 3.2, "tokens": 2048},
    )
    report["prompts"][1] = _prompt("Count: 1, 2, 3,", 0.7, " 4, 5, 6", " 4, 7, 7")
    report["prompts"][2] = _prompt(f"Explain {SCRIPT} & $x$", 0.5, f" ok {SCRIPT}", "")
    return report


def _junit(report: dict[str, Any], tmp_path: Path) -> ET.Element:
    path = tmp_path / "verify.junit.xml"
    write_junit(report, path)
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    return suite


def _cases(suite: ET.Element) -> dict[str, ET.Element]:
    return {case.get("name", ""): case for case in suite.findall("testcase")}


def test_junit_of_a_passing_report(tmp_path: Path) -> None:
    suite = _junit(passing_report(), tmp_path)
    cases = _cases(suite)
    gates = ["top1", "kl_mean", "perplexity_delta", "greedy_agreement", "no_empty_output"]
    assert set(gates) <= set(cases)
    assert {f"prompt[{i}]" for i in range(3)} <= set(cases)
    assert suite.get("name") == "trt-builder verify"
    assert int(suite.get("tests", "")) == len(cases)
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert suite.get("skipped") == "1"  # greedy agreement has no gate
    assert cases["greedy_agreement"].find("skipped") is not None
    assert all(c.get("classname") == "verify.reference" for c in cases.values())
    assert float(suite.get("time", "")) == pytest.approx(12.3)
    assert "Paris" in (cases["prompt[0]"].findtext("system-out") or "")


def test_junit_of_a_failing_report(tmp_path: Path) -> None:
    suite = _junit(failing_report(), tmp_path)
    cases = _cases(suite)
    failed = {name for name, case in cases.items() if case.find("failure") is not None}
    assert failed == {"top1", "kl_mean", "perplexity_delta", "no_empty_output", "fatal_findings"}
    assert int(suite.get("failures", "")) == len(failed)
    skipped = sum(case.find("skipped") is not None for case in cases.values())
    assert int(suite.get("skipped", "")) == skipped == 1
    for name, text in zip(
        ["top1", "kl_mean", "perplexity_delta", "no_empty_output", "fatal_findings"],
        FAILURES,
        strict=True,
    ):
        failure = cases[name].find("failure")
        assert failure is not None
        assert failure.get("message") == text
        body = failure.text or ""
        assert text in body
        assert all(d["cause"] in body and d["evidence"] in body for d in DIAGNOSIS)
    suite_out = suite.findtext("system-out") or ""
    assert all(d["cause"] in suite_out and d["evidence"] in suite_out for d in DIAGNOSIS)
    assert SCRIPT in (cases["prompt[2]"].findtext("system-out") or "")


def test_junit_keeps_control_characters_out(tmp_path: Path) -> None:
    report = passing_report()
    report["prompts"][0]["candidate_text"] = "bell\x07 escape\x1b[0m"
    cases = _cases(_junit(report, tmp_path))
    assert "bell\ufffd escape\ufffd[0m" in (cases["prompt[0]"].findtext("system-out") or "")


def test_html_of_a_failing_report(tmp_path: Path) -> None:
    path = tmp_path / "verify.html"
    write_html(failing_report(), path)
    page = path.read_text(encoding="utf-8")
    assert 'class="banner fail"' in page and "FAILED" in page
    for text in FAILURES:
        assert escape(text) in page
    for d in DIAGNOSIS:
        assert escape(d["cause"]) in page and escape(d["evidence"]) in page
    assert page.count("<svg") == 3
    assert "Plot skipped" not in page
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<mark>7,</mark> 7" in page  # " 4, 7, 7" parts from " 4, 5, 6" at "7,"
    assert "<mark>5,</mark> 6" in page
    assert "<mark>ok</mark> &lt;script&gt;" in page  # the candidate's output is empty
    # self-contained: the only URLs are the SVG namespace names, references are in-page
    assert set(re.findall(r"https?://[^\"'\s<>]+", page)) <= set(SVG_NAMESPACES)
    assert not re.search(r"""<link|src=|url\(\s*['"]?[^#'"\s]""", page)


def test_html_of_a_passing_report_without_layers(tmp_path: Path) -> None:
    report = passing_report()
    del report["by_layer"]
    report["by_position"] = []
    path = tmp_path / "verify.html"
    write_html(report, path)
    page = path.read_text(encoding="utf-8")
    assert 'class="banner pass"' in page and "PASSED" in page
    assert "Failures" not in page
    assert "&lt;b&gt;HTML&lt;/b&gt;" in page and "<mark>" not in page
    assert page.count("<svg") == 1  # only agreement by prompt
    assert "Plot skipped: the report has no by_layer data." in page
    assert "Plot skipped: the report has no by_position data." in page
    assert "<script" not in page.lower()
    assert "INT8 recipe" not in page  # no search ran


def test_html_shows_the_int8_recipe(tmp_path: Path) -> None:
    report = passing_report()
    report["recipe"] = {
        "method": "global alphas <and> per layer",
        "tokens": 4096,
        "chosen": "per layer",
        "candidates": [
            {"name": "alpha 0.7", "kl": 0.01054, "kl_se": 0.00042, "ppl_delta_pct": 1.093,
             "ppl_delta_pct_se": 0.31, "top1": 0.9473, "top1_se": 0.0033, "windows": 8},
            {"name": "per layer", "kl": 0.00846, "kl_se": 0.00048, "ppl_delta_pct": 0.75,
             "ppl_delta_pct_se": 0.22, "top1": 0.9514, "top1_se": 0.0025, "windows": 16},
        ],
    }  # fmt: skip
    write_html(report, tmp_path / "verify.html")
    page = (tmp_path / "verify.html").read_text(encoding="utf-8")
    section = page[page.index("<h2>INT8 recipe</h2>") :].split("<h2>")[1]
    assert "global alphas &lt;and&gt; per layer" in section and "4096 search-split" in section
    assert (
        "<td>alpha 0.7</td><td>0.01054 ± 0.00042</td><td>+1.09% ± 0.31%</td>"
        "<td>0.9473 ± 0.0033</td><td>8</td><td></td>" in section
    )
    assert "<td>per layer</td><td>0.00846 ± 0.00048</td>" in section
    assert "<td>16</td><td>chosen</td>" in section


def test_write_reports_leaves_only_the_two_files(tmp_path: Path) -> None:
    out = tmp_path / "reports"
    paths = write_reports(failing_report(), out)
    assert paths == {"junit": out / "verify.junit.xml", "html": out / "verify.html"}
    assert sorted(p.name for p in out.iterdir()) == ["verify.html", "verify.junit.xml"]
    write_reports(passing_report(), out)  # rewriting replaces them whole
    assert sorted(p.name for p in out.iterdir()) == ["verify.html", "verify.junit.xml"]
    assert "PASSED" in (out / "verify.html").read_text(encoding="utf-8")


def test_write_reports_names_the_files_after_a_stem(tmp_path: Path) -> None:
    paths = write_reports(passing_report(), tmp_path, stem="my-report")
    assert paths == {"junit": tmp_path / "my-report.junit.xml", "html": tmp_path / "my-report.html"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-report.html", "my-report.junit.xml"]


def test_importing_reports_does_not_import_matplotlib() -> None:
    code = "import sys, trt_builder.verify.reports; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
