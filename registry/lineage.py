"""Lineage lookups: from a model version back to the artifacts of the pipeline run that made it."""

from __future__ import annotations

from pathlib import Path

from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient

from registry.models import current_champion


def champion(client: MlflowClient, name: str) -> ModelVersion | None:
    """The version ``name@champion`` points at, or None (no model or no champion yet)."""
    version = current_champion(client, name)
    return None if version is None else client.get_model_version(name, version)


def stage_artifact(client: MlflowClient, version: ModelVersion, stage: str, path: str, dst: Path) -> Path:
    """Download artifact ``path`` of the ``stage`` run in the pipeline run that produced ``version``.

    A stage the pipeline run reused from an earlier run (tag ``sim2edge.reused.<stage>``) is read there."""
    parent = version.tags.get("sim2edge.pipeline_run_id")
    if not parent:
        raise ValueError(f"model version {version.name} v{version.version} has no sim2edge.pipeline_run_id tag")
    run = client.get_run(parent)
    parent = run.data.tags.get(f"sim2edge.reused.{stage}", parent)
    experiment = run.info.experiment_id
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}' and tags.`sim2edge.stage` = '{stage}'")
    if not runs:
        raise ValueError(f"pipeline run {parent} of {version.name} v{version.version} has no {stage!r} stage run")
    dst.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(runs[0].info.run_id, path, str(dst)))
