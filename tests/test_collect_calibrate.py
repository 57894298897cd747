"""Collection from the stand-in robot and calibration of the twin against its hidden truth."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from stages import logs, standin
from stages.collect import CollectConfig, collect
from stages.twin.calibrate import CalibrateConfig, calibrate


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return collect(CollectConfig(episodes=8), tmp_path_factory.mktemp("ds") / "dataset")


def test_dataset_has_manifest_schema_and_named_columns(dataset):
    manifest = json.loads((dataset.path / "manifest.json").read_text())
    assert manifest["schema_version"] == logs.SCHEMA_VERSION
    assert manifest["robot"] == "stand-in:cartpole" and "stand-in" in manifest["source"]
    assert manifest["rows"] == dataset.rows == 8 * 250
    table = logs.read(dataset.path / "part-000.parquet")
    assert {"obs.cart_pos", "obs.pole_angvel", "act.slide", "ctrl.0", "qpos.1", "qvel.1"} <= set(table.column_names)
    assert np.all(np.isfinite(logs.columns(table, "qpos")))


def test_dataset_digest_is_reproducible(dataset, tmp_path):
    again = collect(CollectConfig(episodes=8), tmp_path / "again")
    assert again.digest == dataset.digest
    other = collect(CollectConfig(episodes=8, seed=1), tmp_path / "other")
    assert other.digest != dataset.digest


def test_unknown_schema_version_is_refused(dataset, tmp_path):
    table = pq.read_table(dataset.path / "part-000.parquet").replace_schema_metadata({b"sim2edge.schema_version": b"99"})
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet: schema version"):
        logs.read(tmp_path / "bad.parquet")


def test_calibration_recovers_hidden_parameters(dataset, tmp_path):
    twin = calibrate(CalibrateConfig(generations=30), dataset, tmp_path / "twin")
    truth = standin.hidden_params("cartpole")
    for name in ("damping", "actuator_gain", "mass"):
        assert getattr(twin.params, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    assert twin.replay_error_after * 5 < twin.replay_error_before
    spec = json.loads(twin.path.read_text())
    assert spec["dataset_digest"] == dataset.digest and spec["digest"] == twin.digest
