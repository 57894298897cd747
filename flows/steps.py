"""Pipeline steps: one stage call inside its MLflow run, with everything it logs.

The Prefect flows wrap these as tasks; the standalone commands (``sim2edge collect``,
``sim2edge calibrate``) call them directly, so both log the same runs.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Literal, Optional

from flows.gate import log_gate
from flows.workspace import Workspace
from registry import telemetry
from registry.datasets import log_dataset_input
from registry.tracking import RunContext, flatten, stage_run
from stages.artifacts import Dataset, TwinSpec
from stages.collect.ingest import StandinConfig, ingest_folder, record_standin
from stages.collect.store import DatasetStore, IngestReport
from stages.sim.registry import load
from stages.twin.calibrate import CalibrateConfig, calibrate
from stages.twin.hil_evaluate import HilReport
from stages.twin.hil_stage import HilSettings, hil_metrics, run_hil_stage
from stages.twin.report import write_hil

Source = Literal["standin", "folder", "registry"]


def dataset_store(ws: Workspace, task_ref: str) -> DatasetStore:
    task = load(task_ref)
    return DatasetStore(ws.datasets / task.name, task, task_ref)


def existing_dataset(ws: Workspace, task_ref: str, version: int) -> Dataset:
    """Version ``version`` of the task's dataset store, as ``sim2edge collect`` left it (a KeyError naming the
    versions there if it has none such)."""
    return dataset_store(ws, task_ref).version(f"v{version:04d}")


def collect_step(ctx: RunContext, ws: Workspace, task_ref: str, source: Source = "standin",
                 standin: StandinConfig = StandinConfig(), folder: Optional[Path] = None) -> IngestReport:
    """Ingest new logs from ``source`` into the task's dataset store; log the resulting version."""
    store = dataset_store(ws, task_ref)
    params = {"task": task_ref, "source": source, **({"folder": folder} if folder else {}),
              **(standin.model_dump() if source == "standin" else {})}
    with stage_run(ctx, "collect", params) as run:
        if source == "standin":
            report = record_standin(store, standin, ws.standin_uploads / store.task.name)
        elif source == "folder":
            if folder is None:
                raise ValueError("source 'folder' needs a folder")
            report = ingest_folder(store, folder)
        else:
            key = f"registry:{ctx.tracking_uri}"
            with tempfile.TemporaryDirectory() as tmp:
                files, newest = telemetry.fetch_new(ctx.client, store.task.name, store.watermark(key), Path(tmp))
                report = store.ingest(files, key, watermark=newest)
        run.text("ingest_report.json", report.model_dump_json(indent=2))
        run.metrics({"added_files": len(report.added), "duplicate_files": len(report.duplicates),
                     "quarantined_files": len(report.quarantined)})
        ds = report.dataset
        if ds is None:
            reasons = "; ".join(q.reason for q in report.quarantined) or "no log files found"
            raise ValueError(f"no dataset for task {task_ref!r} in {store.root}: {reasons}")
        run.tags({"sim2edge.dataset_digest": ds.digest, "sim2edge.dataset_version": ds.version,
                  "sim2edge.robots": ",".join(json.loads((ds.path / "manifest.json").read_text())["robots"])})
        run.metrics({"rows": ds.rows, "episodes": ds.episodes})
        run.artifact(ds.path / "manifest.json", "dataset")
        log_dataset_input(ctx.client, run.run_id, ds, "collect")
    return report


def calibrate_step(ctx: RunContext, cfg: CalibrateConfig, dataset: Dataset, out: Path) -> TwinSpec:
    """Fit the twin to ``dataset``; log the fit, its report and the replay plot."""
    with stage_run(ctx, "calibrate", {**cfg.model_dump(), "dataset_version": dataset.version}) as run:
        log_dataset_input(ctx.client, run.run_id, dataset, "calibrate")
        twin = calibrate(cfg, dataset, out)
        run.metrics({"replay_error_before": twin.replay_error_before, "replay_error_after": twin.replay_error_after,
                     **flatten(twin.params.model_dump(), "fitted_"),  # per-joint values as fitted_damping_by_joint.<joint>
                     **{f"interval_{end}_{name}": v for name, bounds in twin.intervals.items()
                        for end, v in zip(("lo", "hi"), bounds)}})
        run.tags({"sim2edge.twin_digest": twin.digest, "sim2edge.dataset_digest": dataset.digest,
                  "sim2edge.unidentified": ",".join(twin.unidentified) or "none"})
        run.artifact(out, "twin")
    return twin.model_copy(update={"run_id": run.run_id})


def hil_step(ctx: RunContext, cfg: HilSettings, bundle: Path, trusted: Path, onnx: Path, task_ref: str,
             twin: TwinSpec, seed: int, out: Path) -> HilReport:
    """The packaged bundle over hardware-in-the-loop; log its metrics, verdict, clauses and ``hil.json``."""
    with stage_run(ctx, "hil_evaluate", {**cfg.model_dump(), "seed": seed}) as run:
        report = run_hil_stage(cfg, bundle, trusted, onnx, task_ref, twin.params, seed, out)
        run.metrics({re.sub(r"[^\w./ -]", "_", k): v for k, v in hil_metrics(report).items()})
        run.tags({"sim2edge.hil_gate": "pass" if report.passed else "fail",
                  "sim2edge.hil_runtime": report.device_runtime or "unknown"})
        run.text("hil.json", report.to_json())
        out.mkdir(parents=True, exist_ok=True)
        run.artifact(write_hil(json.loads(report.to_json()), out / "hil.html"))
        log_gate(ctx.client, run.run_id, report.checks)
    return report
