"""Human output: per-stage progress lines and the summary table (on stderr)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.status import Status
from rich.table import Table

from ..core.stage import StageRecord
from ..pipeline.build import BuildResult

STYLE = {
    "ran": "green",
    "cached": "cyan",
    "skipped": "yellow",
    "failed": "red",
    "cached-failed": "red",
    "would run": "magenta",
}


class StageProgress:
    """A spinner while a stage runs, then one line with its status."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.status: Status | None = None
        self.started = time.monotonic()

    def __call__(self, event: str, name: str, record: StageRecord | str | None) -> None:
        if event == "start":
            self.status = self.console.status(f"[bold]{name}[/] running…")
            self.status.start()
            self.started = time.monotonic()
            return
        if event == "progress":  # the phase line of a long stage (trtllm-build's phases)
            elapsed = time.monotonic() - self.started
            line = f"[bold]{name}[/] {escape(str(record))} [dim](at {elapsed:.0f} s)[/]"
            if self.console.is_terminal and self.status is not None:
                self.status.update(line)
            else:  # a CI log: one line per phase
                self.console.print(f"  {line}")
            return
        assert not isinstance(record, str)
        if self.status is not None:
            self.status.stop()
            self.status = None
        if record is None:  # "abort": the stage raised; the error line follows
            self.console.print(f"  [red]{'error':>8}[/] {name}")
            return
        style = STYLE.get(record.status, "white")
        self.console.print(
            f"  [{style}]{record.status:>8}[/] {name:<8} {record.seconds:7.2f}s  {escape(detail(record))}"
        )


def verify_figures(report: dict[str, Any]) -> str:
    """The headline verify figures that the runtime produced."""
    parts = []
    if report.get("top1") is not None:
        parts.append(f"top-1 {report['top1']:.4f}, KL {report['kl_mean']:.2e}")
    delta = report.get("ppl_delta_pct", (report.get("perplexity") or {}).get("delta_pct"))
    if delta is not None:
        parts.append(f"perplexity {delta:+.2f}%")
    parts.append(f"greedy {report['greedy_agreement']:.2f}")
    return ", ".join(parts)


def detail(record: StageRecord) -> str:
    d: dict[str, Any] = record.details
    if record.name == "verify" and "greedy_agreement" in d:
        return ("pass: " if d.get("passed") else "FAIL: ") + verify_figures(d)
    if record.name == "engine" and record.status == "skipped":
        return d.get("reason", "")
    if record.name == "package":
        if d.get("backend") == "reference":
            return "tensorrt_llm on the reference backend (PyTorch, not TensorRT-LLM)"
        return "engine included" if d.get("engine_included") else "configs only (no engine yet)"
    if record.name == "fetch" and "source" in d:
        src = d["source"]
        return (
            f"{src['kind']} {Path(src['ref']).name if src['kind'] != 'hub' else src['ref']} -> hf/"
        )
    if record.name == "convert" and "quant_algo" in d:
        return f"{d.get('architecture')} {d.get('dtype')} quant={d.get('quant_algo')}"
    return record.output


def summary(console: Console, result: BuildResult) -> None:
    table = Table(
        title=f"{result.layout.model} @ {result.layout.revision[:19]} · {result.layout.variant}"
    )
    for col in ("stage", "status", "seconds", "detail"):
        table.add_column(col)
    for record in result.records:
        style = STYLE.get(record.status, "white")
        table.add_row(
            record.name,
            f"[{style}]{record.status}[/]",
            f"{record.seconds:.2f}",
            escape(detail(record)),
        )
    console.print(table)
    for notice in result.notices:
        console.print(f"[yellow]note:[/] {escape(notice)}")
    engine = next((r for r in result.records if r.name == "engine"), None)
    if engine and engine.status == "skipped" and "command" in engine.details:
        console.print(
            "[yellow]engine skipped:[/] TensorRT-LLM is not installed here. On a GPU host with TensorRT-LLM (e.g. the NGC container) run:"
        )
        console.print(engine.details["command"], markup=False, highlight=False, soft_wrap=True)
    package = next((r for r in result.records if r.name == "package"), None)
    if package and "command" in package.details:  # the llmapi target, outside Triton
        console.print("[green]trtllm-serve:[/] to serve the checkpoint outside Triton, run:")
        console.print(package.details["command"], markup=False, highlight=False, soft_wrap=True)
    if result.engine_plan is not None:
        console.print("engine command:", result.engine_plan["command"], markup=False,
                      highlight=False, soft_wrap=True)  # fmt: skip
        memory = result.engine_plan["memory"]
        if isinstance(memory, str):
            console.print(f"memory plan: {memory}", markup=False, soft_wrap=True)
        else:
            gib = memory["gib"]
            console.print(
                f"memory plan on {memory['gpu']} per rank: weights {gib['weight_bytes']} GiB, "
                f"activations ~{gib['activation_bytes']} GiB, KV cache {gib['kv_budget_bytes']} GiB "
                f"= {memory['kv_tokens']} tokens, {memory['max_sequences_at_max_seq_len']} sequences "
                f"of {memory['limits']['max_seq_len']} at once; max_batch_size "
                f"{memory['limits']['max_batch_size']}, max_num_tokens "
                f"{memory['limits']['max_num_tokens']}",
                markup=False, soft_wrap=True,
            )  # fmt: skip
    if not result.dry_run:
        console.print(f"manifest: {result.layout.manifest}", markup=False)
        console.print(f"done in {result.seconds:.2f}s")


def bench_table(result: dict[str, Any]) -> str:
    """A bench result's points, a line each: the figures a person looks at first."""
    from ..bench.report import served_by

    lines = [f"{result['target']} ({result['url']}; {served_by(result)})",
             f"{'load':<16}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}"
             f"{'E2E p50':>9}{'p99':>8}{'errors':>9}"]  # fmt: skip
    for p in result["points"]:

        def m(key: str, spec: str = ".0f", s: dict[str, Any] = p["summary"]) -> str:
            x = s[key]["mean"]
            return "-" if x is None else format(x, spec)

        errors = sum(int(r["errors"]) for r in p["repeats"])
        requests = sum(int(r["requests"]) for r in p["repeats"])
        lines.append(f"{p['mode'] + ' ' + format(p['load'], 'g'):<16}{m('request_throughput', '.2f'):>8}"
                     f"{m('output_token_throughput', '.1f'):>9}{m('ttft_ms.p50'):>10}{m('ttft_ms.p99'):>8}"
                     f"{m('itl_ms.p50', '.1f'):>9}{m('e2e_ms.p50'):>9}{m('e2e_ms.p99'):>8}"
                     f"{f'{errors}/{requests}':>9}")  # fmt: skip
    return "\n".join(lines)
