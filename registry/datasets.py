"""Dataset versions as MLflow dataset inputs (``mlflow.data``) of the runs that use them."""

from __future__ import annotations

import json
import warnings

from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, DataType, Schema

from stages.artifacts import Dataset
from stages.collect.store import dataset_files
from stages import logs


def log_dataset_input(client: MlflowClient, run_id: str, dataset: Dataset, context: str) -> None:
    """Record ``dataset`` (name ``<task>-v<N>``, its digest, its columns) as an input of ``run_id``."""
    with warnings.catch_warnings():  # two registered source types both claim file:// URIs
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(dataset.path.resolve().as_uri())
    columns = logs.read(dataset_files(dataset)[0]).schema.names
    schema = Schema([ColSpec(DataType.string if c in logs.STRING_COLUMNS else DataType.double, c) for c in columns])
    meta = MetaDataset(source, name=f"{dataset.task}-v{dataset.version:04d}", digest=dataset.digest[:32], schema=schema)
    manifest = json.loads((dataset.path / "manifest.json").read_text())
    tags = [InputTag("mlflow.data.context", context), InputTag("sim2edge.dataset_digest", dataset.digest),
            InputTag("sim2edge.rows", str(dataset.rows)), InputTag("sim2edge.robots", ",".join(manifest["robots"]))]
    inputs = [DatasetInput(meta._to_mlflow_entity(), tags=tags)]
    try:
        client.log_inputs(run_id, datasets=inputs)
    except MlflowException as e:
        # MLflow's store looks the dataset up, then inserts it: two runs of one experiment logging the same dataset at
        # once on PostgreSQL both insert, the second fails on the unique (experiment, name, digest) with a 400; the
        # dataset exists now, so the same call again links this run to it
        if "duplicate key" not in str(e) and "UNIQUE constraint" not in str(e):
            raise
        client.log_inputs(run_id, datasets=inputs)
