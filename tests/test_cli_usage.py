"""The CLI's usage errors, which need no model built (the fast tier): one line, the fix named,
a documented exit code, no traceback unless --debug."""

from __future__ import annotations

import json

import pytest

from trt_builder.cli.main import main


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["build", "--tp", "0"], 2, "tp must be a positive integer"),
        (["build", "--dtype", "int4"], 2, "Invalid value for '--dtype'"),
        (["build", "--model", "/nowhere/model.gguf"], 3, "does not exist: check the --model path"),
        (
            ["build", "--model", "nota repo"],
            3,
            "is not an existing directory, a .gguf file or a hub repo id",
        ),
        (["verify", "--checkpoint", "."], 2, "--reference (the HF model directory) is needed"),
        (["verify", "--reference", "."], 2, "--checkpoint and --reference go together"),
        (["verify", "--runtime", "triton", "--reference", "."], 2, "--runtime triton needs --url"),
        (
            ["verify", "--runtime", "tensorrt-llm", "--reference", "."],
            2,
            "--runtime tensorrt-llm needs --engine DIR",
        ),
        (["build", "--revision", "main"], 3, "--revision applies to hub repo ids"),
    ],
)
def test_errors_are_one_line_with_exit_codes(
    args: list[str], code: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    got = main(list(args))
    err = capsys.readouterr().err
    assert got == code and needle in err and "Traceback" not in err


def test_output_options_are_read_from_the_command_not_from_the_raw_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--json` and `--debug` are options of the command: a prompt that reads "--json" is a
    prompt, and the error stays one line on stderr with nothing on stdout."""
    url = "http://127.0.0.1:9"  # nothing listens there
    assert main(["infer", "--url", url, "--prompt", "--json"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: cannot reach Triton") and "Traceback" not in err
    assert main(["infer", "--url", url, "--prompt", "hi", "--json", "--debug"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out) == {"ok": False, "exit_code": 3, "error": err.splitlines()[-1][7:]}
    assert "Traceback" in err


def test_infer_without_a_server_or_a_prompt_names_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["infer", "--url", "http://127.0.0.1:9", "--prompt", "x", "--timeout", "2"]) == 3
    assert "cannot reach Triton at http://127.0.0.1:9" in capsys.readouterr().err
    assert main(["infer", "--url", "http://127.0.0.1:9"]) == 3
    assert "give one of --prompt and --messages" in capsys.readouterr().err
