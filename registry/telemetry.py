"""Device telemetry in the registry: the contract between ``sim2edge-agent upload`` and collect.

A telemetry upload is one MLflow run in experiment ``sim2edge/telemetry`` tagged
``sim2edge.telemetry=true``, ``sim2edge.task``, ``sim2edge.device`` and ``sim2edge.policy_version``,
with the log files (the collect log format's Parquet, or the agent's ``.npz`` or ``.mcap`` telemetry that collect
converts: stages/collect/device_logs.py) as artifacts under ``telemetry/``. Collect reads
runs that started at or after its watermark (the newest run start time it has read).
"""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

EXPERIMENT = "sim2edge/telemetry"


def upload(client: MlflowClient, files: list[Path], task: str, device: str, policy_version: str) -> str:
    """Upload log files as one telemetry run; returns its run id."""
    found = client.get_experiment_by_name(EXPERIMENT)
    experiment = found.experiment_id if found else client.create_experiment(EXPERIMENT)
    run = client.create_run(experiment, run_name=f"telemetry {device}", tags={
        "sim2edge.telemetry": "true", "sim2edge.task": task, "sim2edge.device": device,
        "sim2edge.policy_version": policy_version})
    for f in files:
        client.log_artifact(run.info.run_id, str(f), "telemetry")
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def fetch_new(client: MlflowClient, task: str, since_ms: int, dst: Path) -> tuple[list[Path], int]:
    """Download telemetry of ``task`` from finished runs started at or after ``since_ms``; returns (files, newest start)."""
    found = client.get_experiment_by_name(EXPERIMENT)
    if found is None:
        return [], since_ms
    runs = client.search_runs(
        [found.experiment_id],
        f"tags.`sim2edge.telemetry` = 'true' and tags.`sim2edge.task` = '{task}' "
        f"and attributes.start_time >= {since_ms} and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time ASC"], max_results=10000,
    )
    files: list[Path] = []
    for run in runs:
        local = Path(client.download_artifacts(run.info.run_id, "telemetry", str(dst / run.info.run_id)))
        files += sorted(p for pattern in ("*.parquet", "*.npz", "*.mcap") for p in local.glob(pattern))
    return files, max([since_ms] + [r.info.start_time for r in runs])
