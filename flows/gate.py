"""The evaluation gate as people read it: one verdict line for the run summary, and every clause (logged as
``gate.json`` on the pipeline run) for ``sim2edge gate show``."""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from mlflow.tracking import MlflowClient

from stages.twin.gate import Check

GATE_FILE = "gate.json"
REPORT_FILE = "evaluation/report.json"
"""Where ``sim2edge evaluate`` and the evaluate stage keep the same clauses (``checks``) on their own runs."""

_DETAIL = re.compile(r"(?P<value>.+?) (?P<op>>=|<=|<|>) (?P<threshold>.+)")
_NEGATED = {">=": "<", "<=": ">", "<": ">=", ">": "<="}


@dataclass(frozen=True)
class Clause:
    """One gate check split into columns: ``scenario`` is empty for a whole-suite check; ``threshold`` carries the
    comparison that passes (``>= 0.8``)."""

    passed: bool
    scenario: str
    check: str
    value: str
    threshold: str

    @classmethod
    def of(cls, c: Check) -> "Clause":
        scenario, _, check = c.name.rpartition(": ")
        m = _DETAIL.fullmatch(c.detail)
        value, threshold = (m["value"], f"{m['op']} {m['threshold']}") if m else (c.detail, "")
        return cls(c.passed, scenario, check, value, threshold)

    def failure(self) -> str:
        """Short, as the verdict line lists it: ``damping+30% success rate 0.410 < 0.6``."""
        op, _, bound = self.threshold.partition(" ")
        name = " ".join(filter(None, (self.scenario, self.check.replace(" lower 95% bound", ""))))
        return f"{name} {self.value} {_NEGATED.get(op, op)} {bound}".rstrip()


def verdict(checks: Iterable[Check], width: int = 100) -> str:
    """``pass 12/12``, or ``FAIL 2/12: `` and the failing clauses, as many as fit ``width`` (then ``+N more``)."""
    checks = list(checks)
    failed = [Clause.of(c).failure() for c in checks if not c.passed]
    if not failed:
        return f"pass {len(checks)}/{len(checks)}"
    line = f"FAIL {len(failed)}/{len(checks)}: {failed[0]}"
    for i, clause in enumerate(failed[1:], 1):
        rest = f"; +{len(failed) - i - 1} more" if i < len(failed) - 1 else ""
        if len(f"{line}; {clause}{rest}") > width:
            return f"{line}; +{len(failed) - i} more"
        line += f"; {clause}"
    return line


def log_gate(client: MlflowClient, run_id: str, checks: Iterable[Check]) -> None:
    """Every clause on ``run_id`` as ``gate.json`` (``passed``, ``checks``: the shape of the evaluation report)."""
    checks = [c.model_dump() for c in checks]
    client.log_dict(run_id, {"passed": all(c["passed"] for c in checks), "checks": checks}, GATE_FILE)


def resolve_run(client: MlflowClient, ref: str) -> str:
    """The run id of ``ref``: a run id, or a registered version (``NAME@ALIAS``, ``NAME@VERSION``) whose pipeline
    run it is. Raises ValueError with a one-line message."""
    if "@" not in ref:
        return ref
    name, _, which = ref.partition("@")
    try:
        version = client.get_model_version(name, which) if which.isdigit() else client.get_model_version_by_alias(name, which)
    except Exception as e:  # MlflowException for an unknown name, alias or version
        raise ValueError(f"{ref}: no such registered version ({str(e).splitlines()[0]})") from None
    run_id = version.tags.get("sim2edge.pipeline_run_id")
    if not run_id:
        raise ValueError(f"{ref} (v{version.version}) has no sim2edge.pipeline_run_id tag: not made by the pipeline")
    return run_id


def load_checks(client: MlflowClient, run_id: str) -> list[Check]:
    """The gate clauses logged on a run: its ``gate.json`` (a pipeline run), else its evaluation report (an
    evaluate run). Raises ValueError with a one-line message."""
    try:
        names = {a.path for a in client.list_artifacts(run_id)}
    except Exception as e:  # MlflowException for an unknown run id
        raise ValueError(f"run {run_id}: {str(e).splitlines()[0]}") from None
    path = GATE_FILE if GATE_FILE in names else REPORT_FILE if "evaluation" in names else None
    if path is None:
        raise ValueError(f"run {run_id} has no gate: neither {GATE_FILE} nor {REPORT_FILE}")
    with tempfile.TemporaryDirectory() as tmp:
        doc = json.loads(Path(client.download_artifacts(run_id, path, tmp)).read_text())
    return [Check(**c) for c in doc["checks"]]
