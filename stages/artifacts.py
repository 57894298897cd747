"""Typed artifacts that flow between stages. Each names its files and carries a content digest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel, ConfigDict, Field

from stages.sim.params import PhysicalParams


def sha256_json(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to ``final`` only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_partial(root: Path) -> list[Path]:
    """Delete what an interrupted ``atomic_dir`` left under ``root`` (its hidden temporary siblings)."""
    partial = [p for p in root.rglob(".*") if p.is_dir() and "." in p.name[1:]] if root.exists() else []
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


class Artifact(BaseModel):
    """Every artifact's ``task`` is the task reference it was made with (a name or ``module:Class``)."""

    model_config = ConfigDict(frozen=True)
    path: Path
    digest: str
    run_id: str | None = None
    """The MLflow run that produced it (set by the pipeline; None outside one)."""


class Dataset(Artifact):
    """One immutable dataset version: ``path`` holds its ``manifest.json`` (files, digests, rows, robots)."""

    task: str
    version: int
    source: str
    episodes: int
    rows: int


class Misfit(BaseModel):
    """How far the calibrated twin's replay error stays above what sensor noise explains."""

    model_config = ConfigDict(frozen=True)
    ratio: float
    """Replay error after calibration over the noise floor (the error noise alone would leave)."""
    noise_floor: float
    joint_error: dict[str, float]
    """Replay error per replayed joint, named by MJCF joint name."""
    worst_joints: tuple[str, ...] = ()
    """Joints whose own error exceeds the threshold ratio, worst first (empty: the twin fits)."""


class TwinSpec(Artifact):
    """The calibrated digital twin: fitted parameters, their intervals and the data they came from."""

    task: str
    params: PhysicalParams
    intervals: dict[str, tuple[float, float]] = {}
    """Bootstrap interval per fitted parameter, in its ``params`` units: the global ones by name, per-joint ones as
    ``<field>.<joint or actuator>`` (e.g. ``damping_by_joint.joint0``, a multiplier); the global fit's hold the truth
    together with 95%, and so do the per-joint fit's (``stages.twin.intervals``). Empty: not calibrated."""
    unidentified: tuple[str, ...] = ()
    """Parameters the data could not pin down; they are held at the prior."""
    dataset_digest: str
    standin_truth: PhysicalParams | None = None
    """The reference robot's hidden parameters when the data came from the stand-in (for checking only)."""
    replay_error_before: float
    replay_error_after: float
    misfit: Misfit | None = None
    """Set by calibration: the leftover error and the joints it sits on."""


class Checkpoint(Artifact):
    """An rsl_rl-format checkpoint (actor incl. observation normalizer, critic, optimizer)."""

    task: str
    iterations: int
    final_return: float
    hidden_dims: tuple[int, ...]


class ExportedPolicy(Artifact):
    """``policy.onnx`` with normalization and the deterministic action inside the graph."""

    task: str
    opset: int
    parity_max_abs_error: float
    golden: Path
    golden_unsaturated_fraction: float | None = None
    """Fraction of the golden outputs inside the action clip (None: not recorded, e.g. a registry download)."""


class ScenarioResult(BaseModel):
    """One row of the evaluation table."""

    model_config = ConfigDict(frozen=True)
    name: str
    success_rate: float
    success_low: float
    mean_return: float
    champion_success_rate: float | None = None
    champion_mean_return: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    """{name: mean} of the task's episode metrics (``Task.metrics``)."""


class EvalReport(Artifact):
    """The scenario suite run with the exported policy in the twin, and the gate decision.

    ``success_rate`` and ``mean_return`` are the nominal scenario's; ``html`` is the report people read."""

    html: Path
    episodes: int
    success_rate: float
    mean_return: float
    passed: bool
    reasons: tuple[str, ...]
    scenarios: tuple[ScenarioResult, ...] = ()
    latency_ms_p99: float | None = None
    sim_to_real_gap: dict[str, float] | None = None
    """Closed-loop joint-trajectory RMS error against the stand-in robot: ``twin`` and ``uncalibrated``."""
    champion_version: str | None = None
    """The champion compared against on the same seeds (None: there was none)."""
    champion_mean_return: float | None = None
    champion_success_rate: float | None = None


class BundleArtifact(Artifact):
    """A signed device bundle (one tar file)."""

    target: str
    policy: str
    version: str
