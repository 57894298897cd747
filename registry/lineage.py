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

    The pipeline run names the stage run whose result it used (tag ``sim2edge.stage_run.<stage>``: the
    best of several training seeds, or a run reused from an earlier pipeline run)."""
    parent = version.tags.get("sim2edge.pipeline_run_id")
    if not parent:
        raise ValueError(f"model version {version.name} v{version.version} has no sim2edge.pipeline_run_id tag")
    stage_run = client.get_run(parent).data.tags.get(f"sim2edge.stage_run.{stage}")
    if not stage_run:
        raise ValueError(f"pipeline run {parent} of {version.name} v{version.version} names no {stage!r} stage run")
    dst.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(stage_run, path, str(dst)))
