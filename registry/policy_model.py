"""The exported policy as an MLflow Model (``onnx`` flavor), the source of every registered version.

Stock MLflow then loads a version: ``mlflow.onnx.load_model("models:/cartpole@champion")`` gives the
graph; ``mlflow.pyfunc.load_model(...).predict(x)`` takes what a Python user builds: a DataFrame whose columns
are the observation terms (matched by name, any order), or an array, a list of rows or an unnamed DataFrame
with one column per term in the policy's order, of floats, ints or bools (``mlflow models serve`` JSON too).
The model's own ``python_function`` loader (:mod:`registry.sim2edge_pyfunc`, shipped in the model's
``code/``) checks and casts them to the graph's float32 as the device runtime does and refuses, in one line,
a missing term (naming the missing and extra columns), a wrong width, a non-numeric column, an int float32
cannot hold exactly or a value that is not finite. It returns the graph's output (``action``) as one column,
row-major: ``.to_numpy().reshape(len(x), n_actions)`` are the actions the device computes. The signature
declares that output only: an input schema would make MLflow's own enforcement refuse arrays and int64
columns before the loader sees them; the terms (names, units, limits) are in the model's ``metadata`` and
its input example. The signed bundle is an extra file of the model (``extra_files/bundle.tar``); devices
keep pulling it from the package run through the tags ``sim2edge.bundle.*`` (:mod:`registry.models`).

Logged through ``MlflowClient`` with explicit ids, no fluent run or experiment (stages run in
Prefect's worker threads), in the steps ``mlflow.models.Model.log`` takes: create the logged model
(its id is known before the bundle is written, so the version can be reserved first), link it as
an output of the run, save the flavor locally, upload, finalize.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow.onnx
import numpy as np
import onnx
import onnxruntime
import pandas as pd
from mlflow.entities import LoggedModel, LoggedModelOutput, LoggedModelStatus
from mlflow.models import Model, ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import Schema, TensorSpec

from registry import sim2edge_pyfunc
from registry.tracking import serves_artifacts

MODEL_TYPE = "sim2edge-policy"


def signature(io: dict, output_name: str) -> ModelSignature:
    """From the bundle manifest's ``io``: the output tensor (B, actions) under the graph's output name; no input
    schema, so the inputs reach the model's own loader, which checks them against the terms."""
    return ModelSignature(outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, len(io["output"]["terms"])),
                                                     output_name)]))


def input_example(io: dict, golden: Path, rows: int = 4) -> pd.DataFrame:
    """The first golden inputs recorded at export, as named float64 observation columns (what Python builds)."""
    inputs = np.load(golden)["inputs"][:rows].astype(np.float64)
    return pd.DataFrame(inputs, columns=[t["name"] for t in io["input"]["terms"]])


def create(client: MlflowClient, experiment_id: str, run_id: str, name: str, tags: dict[str, str]) -> LoggedModel:
    """A PENDING logged model produced by ``run_id``, linked as the run's output; its id is known before its files."""
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id, model_type=MODEL_TYPE, tags=tags)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    return model


def version_source(client: MlflowClient, model: LoggedModel) -> str:
    """The registered version's source: ``models:/<model id>`` (MLflow 3's form) through a tracking server; the
    model's artifact location for the embedded store, which would resolve ``models:/`` with the process-global
    tracking URI rather than ``client``'s (``SqlAlchemyStore.create_model_version``)."""
    return f"models:/{model.model_id}" if serves_artifacts(client) else model.artifact_location


def upload(client: MlflowClient, model: LoggedModel, onnx_path: Path, golden: Path, bundle: Path, manifest: dict) -> None:
    """Save the policy in the ``onnx`` flavor with the signature and terms of ``manifest`` (the bundle's), an
    input example and the bundle itself; upload it; mark the logged model READY."""
    io = manifest["io"]
    metadata = {"sim2edge.observations": io["input"]["terms"],
                "sim2edge.actions": [{**t, **{k: io["output"][k][i] for k in ("low", "high", "default", "scale", "gear")
                                              if k in io["output"]}} for i, t in enumerate(io["output"]["terms"])],
                "sim2edge.control_period_s": manifest["control"]["period_s"],
                "sim2edge.bundle": f"extra_files/{bundle.name}"}
    graph = onnx.load(str(onnx_path))
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "model"
        mlflow.onnx.save_model(
            graph, str(local),
            mlflow_model=Model(artifact_path=model.artifact_location, model_uuid=model.model_id,
                               run_id=model.source_run_id, model_id=model.model_id),
            signature=signature(io, graph.graph.output[0].name), input_example=input_example(io, golden),
            # pinned, so saving does not spawn a subprocess to infer them
            pip_requirements=[f"onnx=={onnx.__version__}", f"onnxruntime=={onnxruntime.__version__}"],
            metadata=metadata, extra_files=[str(bundle)], save_as_external_data=False,
            code_paths=[sim2edge_pyfunc.__file__])
        use_own_pyfunc_loader(local)
        client.log_model_artifacts(model.model_id, str(local))
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)


def use_own_pyfunc_loader(local: Path) -> None:
    """Point the saved model's ``python_function`` flavor at :mod:`registry.sim2edge_pyfunc` (in its ``code/``)."""
    saved = Model.load(str(local))
    saved.flavors["python_function"]["loader_module"] = sim2edge_pyfunc.__name__.rsplit(".", 1)[-1]
    saved.save(str(local / "MLmodel"))
