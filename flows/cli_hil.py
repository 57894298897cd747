"""``sim2edge evaluate --hil``: the suite against a device in real time, beside in-process, and the HIL gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from flows.cli_output import console, fail
from flows.gate import verdict


def hil_config(devices: list[str], episodes: Optional[int], seed: int, max_steps: Optional[int], suite: Optional[Path],
               scenarios: list[str], dead_after: int):
    """The run's configuration; a bad or repeated address is refused in one line before anything runs."""
    from stages.twin.hil_evaluate import HilSuiteConfig, check_devices

    try:
        check_devices(tuple(devices))
    except ValueError as e:
        fail(f"--hil: {e}")
    return HilSuiteConfig(devices=tuple(devices), seed=seed, max_steps=max_steps, suite=suite, scenarios=tuple(scenarios),
                          dead_after_periods=dead_after, **({"episodes": episodes} if episodes else {}))


def _ci(values: list[float], fmt: str) -> str:
    return f"[{values[0]:{fmt}}, {values[1]:{fmt}}]"


def run_hil_suite(cfg, gate_file: Optional[Path], onnx: Path, task: str, params, label: str, out: Path,
                  graph_sha256: Optional[str] = None) -> None:
    """Run, print the side-by-side table and the verdict line, write ``out``; exit 1 when the gate fails. With
    ``graph_sha256`` (a bundle's ``policy.onnx``) a device serving another graph is refused."""
    from stages.twin.hil_evaluate import hil_evaluate, load_gate
    from stages.twin.report import write_hil

    try:
        cfg.select(task)
        gate = load_gate(gate_file)
    except ValueError as e:
        fail(str(e))
    try:
        report = hil_evaluate(cfg, gate, onnx, task, params, graph_sha256)
    except (OSError, ValueError) as e:  # a failed device is named; devices serving different policies each
        fail(f"--hil: {e}")
    table = Table("scenario", "success in-proc", "success HIL", "return in-proc (95%)", "return HIL (95%)",
                  "misses", "late", "lost", "RTT p50/p99/max ms", "device act p99 µs",
                  title=f"{label}: in-process vs HIL at {', '.join(cfg.devices)} "
                        f"({cfg.episodes} episodes, seed {cfg.seed})")
    for r in report.scenarios:
        base, hil, dev = r["in_process"], r["hil"], r["device"] or {}
        table.add_row(r["scenario"], f"{base['success_rate']:.2f}", f"{hil['success_rate']:.2f}",
                      f"{base['mean_return']:.1f} {_ci(base['mean_return_ci95'], '.1f')}",
                      f"{hil['mean_return']:.1f} {_ci(hil['mean_return_ci95'], '.1f')}",
                      f"{hil['deadline_misses']}/{hil['steps']}", str(hil["late_actions"]), str(hil["lost_actions"]),
                      f"{hil['rtt_ms_p50']:.1f}/{hil['rtt_ms_p99']:.1f}/{hil['rtt_ms_max']:.1f}",
                      str(dev.get("act_p99_us", "-")))
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.to_json())
    write_hil(json.loads(report.to_json()), out.with_suffix(".html"))
    console.print(f"HIL gate {verdict(report.checks, width=240)}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"result {out} ({out.with_suffix('.html').name} beside it)", markup=False, highlight=False,
                  soft_wrap=True)
    if not report.passed:
        raise typer.Exit(1)
