"""One MLflow parent run per pipeline run, a nested run per stage.

Uses ``MlflowClient`` with explicit run ids (no fluent global state), so stages running
in Prefect's worker threads log to the right run.
"""

from __future__ import annotations

import math
import os
import socket
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.time import get_current_time_millis
from pydantic import BaseModel, ConfigDict


class RunContext(BaseModel):
    """Where a pipeline run logs: tracking URI, experiment and parent run. Plain data, hashable."""

    model_config = ConfigDict(frozen=True)
    tracking_uri: str
    experiment_id: str
    parent_run_id: str | None = None
    """None for a standalone stage (``sim2edge collect``): its run is then top-level."""

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(self.tracking_uri)


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""Opens the experiment in the MLflow 3 UI's model-training view (its default is the GenAI view)."""


def serves_artifacts(client: MlflowClient) -> bool:
    """Whether ``client`` talks to a tracking server, which then stores artifacts behind its proxy."""
    return urllib.parse.urlsplit(client.tracking_uri).scheme in ("http", "https")


def ensure_experiment(client: MlflowClient, name: str, artifact_root: Path | None) -> str:
    """The experiment's id, creating it as a model-training experiment.

    Through a tracking server its artifacts go through the server's artifact proxy (``mlflow-artifacts:``),
    which clients on any host can read and write; only the embedded store (no server) keeps them under
    ``artifact_root/<name>`` (``file://``). An experiment made by the embedded store that a server now
    serves is refused unless its folder is on this host's disk (a run before ``sim2edge up``)."""
    found = client.get_experiment_by_name(name)
    if found is None:
        location = (artifact_root / name.replace("/", "-")).resolve().as_uri() \
            if artifact_root and not serves_artifacts(client) else None
        try:
            return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
        except MlflowException as e:
            # another run created it since the read (two runs of a new policy at once on a shared server:
            # PostgreSQL's unique name, RESOURCE_ALREADY_EXISTS): use theirs
            if e.error_code != "RESOURCE_ALREADY_EXISTS" or (found := client.get_experiment_by_name(name)) is None:
                raise
    if found.artifact_location.startswith("file:") and serves_artifacts(client) and not Path(urllib.parse.urlsplit(found.artifact_location).path).is_dir():
        raise ValueError(f"experiment {name!r} keeps its artifacts at {found.artifact_location}, which this host "
                         f"cannot reach (it was created without a tracking server); rename it in the MLflow UI "
                         f"(or `mlflow experiments rename`) and the next run creates one behind {client.tracking_uri}'s "
                         f"artifact proxy")
    for key, value in EXPERIMENT_KIND.items():
        if key not in found.tags:
            client.set_experiment_tag(found.experiment_id, key, value)
    return found.experiment_id


OWNER = "sim2edge.owner"
"""Tag on every run: ``<host>:<pid>`` of the process that logs it, so a killed process's runs can be found."""


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fail_orphans(client: MlflowClient, experiment_id: str) -> list[str]:
    """Mark FAILED the runs left RUNNING by a process of this host that no longer exists (killed mid-run)."""
    host = socket.gethostname()
    orphans = []
    for run in client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=1000):
        who = run.data.tags.get(OWNER, "")
        name, _, pid = who.rpartition(":")
        if name == host and pid.isdigit() and not _alive(int(pid)):
            client.set_tag(run.info.run_id, "sim2edge.failure", f"process {who} ended without finishing this run")
            client.set_terminated(run.info.run_id, "FAILED")
            orphans.append(run.info.run_id)
    return orphans


def flatten(values: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """Nested mappings as dotted keys: ``{"gate": {"min_success_rate": 0.8}}`` → ``{"gate.min_success_rate": 0.8}``."""
    flat: dict[str, object] = {}
    for k, v in values.items():
        if isinstance(v, Mapping):
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def log_params(client: MlflowClient, run_id: str, params: Mapping[str, object]) -> None:
    """Log parameters in one batch, values as text (cut at MLflow's 6000-character limit)."""
    flat = [Param(k, str(v)[:6000]) for k, v in params.items()]
    if flat:
        client.log_batch(run_id, params=flat)


def log_metrics(client: MlflowClient, run_id: str, values: Mapping[str, float], step: int = 0) -> None:
    """Log the finite ``values`` as metrics at ``step`` in one batch."""
    now = get_current_time_millis()
    batch = [Metric(k, float(v), now, step) for k, v in values.items() if math.isfinite(float(v))]
    if batch:
        client.log_batch(run_id, metrics=batch)


def start_pipeline(tracking_uri: str, experiment: str, artifact_root: Path | None, run_name: str,
                   tags: Mapping[str, str], params: Mapping[str, object]) -> RunContext:
    """The parent run of a pipeline run, with the pipeline's parameters (so the runs table compares pipelines)."""
    client = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(client, experiment, artifact_root)
    run = client.create_run(experiment_id, run_name=run_name, tags={**tags, OWNER: owner()})
    log_params(client, run.info.run_id, flatten(params))
    return RunContext(tracking_uri=tracking_uri, experiment_id=experiment_id, parent_run_id=run.info.run_id)


def standalone(tracking_uri: str, experiment: str, artifact_root: Path | None) -> RunContext:
    """Where a single stage run from the CLI logs: the task's experiment, no parent run."""
    client = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(client, experiment, artifact_root)
    fail_orphans(client, experiment_id)
    return RunContext(tracking_uri=tracking_uri, experiment_id=experiment_id)


def finish_pipeline(ctx: RunContext, ok: bool) -> None:
    ctx.client.set_terminated(ctx.parent_run_id, "FINISHED" if ok else "FAILED")


class StageRun:
    """Handle on a stage's nested run."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def metrics(self, values: Mapping[str, float], step: int = 0) -> None:
        log_metrics(self.client, self.run_id, values, step)

    def artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def text(self, name: str, text: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def tags(self, values: Mapping[str, str]) -> None:
        for k, v in values.items():
            self.client.set_tag(self.run_id, k, str(v))

    @property
    def artifact_uri(self) -> str:
        return self.client.get_run(self.run_id).info.artifact_uri


@contextmanager
def stage_run(ctx: RunContext, stage: str, params: Mapping[str, object]) -> Iterator[StageRun]:
    """A nested run for ``stage`` with its params; FAILED if the block raises, FINISHED otherwise."""
    client = ctx.client
    tags = {"sim2edge.stage": stage, OWNER: owner()}
    if ctx.parent_run_id:
        tags["mlflow.parentRunId"] = ctx.parent_run_id
    run = client.create_run(ctx.experiment_id, run_name=stage, tags=tags)
    log_params(client, run.info.run_id, params)
    try:
        yield StageRun(client, run.info.run_id)
    except BaseException:
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    client.set_terminated(run.info.run_id, "FINISHED")
