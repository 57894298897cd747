"""`sim2edge up --artifacts s3://BUCKET/PREFIX`: MLflow keeps its artifacts in an S3 bucket it proxies, so clients
(here the stock client and the devices' telemetry upload) need no S3 credentials; a missing bucket, a dead endpoint or a
bad URI are refused in one line before anything starts.

The S3 server is moto's (``moto[server]``: the S3 REST API over HTTP on loopback, in this process); no MinIO or AWS
endpoint can be reached from here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port, run_cli
from tests.servers import wait_up
from tests.test_up_ports import none_left

boto3 = pytest.importorskip("boto3")
KEYS = {"AWS_ACCESS_KEY_ID": "sim2edge-test", "AWS_SECRET_ACCESS_KEY": "sim2edge-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a loopback port with one bucket; yields (endpoint, bucket)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint, bucket = f"http://127.0.0.1:{port}", f"team-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, **_keys()).create_bucket(Bucket=bucket)
    yield endpoint, bucket
    server.stop()


def _keys() -> dict:
    return {"aws_access_key_id": KEYS["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": KEYS["AWS_SECRET_ACCESS_KEY"],
            "region_name": KEYS["AWS_DEFAULT_REGION"]}


def _env(home: Path, endpoint: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    return {**env, **KEYS, "MLFLOW_S3_ENDPOINT_URL": endpoint, "SIM2EDGE_HOME": str(home)}


def test_mlflow_artifacts_land_in_the_bucket_and_clients_need_no_s3_keys(s3, tmp_path):
    from edge import telemetry

    endpoint, bucket = s3
    home, mlflow_port, prefect_port = tmp_path / "home", free_port(), free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "up", "--mlflow-port", str(mlflow_port),
                               "--prefect-port", str(prefect_port), "--artifacts", f"s3://{bucket}/mlflow"],
                              env=_env(home, endpoint), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_up(up, log)
        assert f"artifacts   s3://{bucket}/mlflow" in log.read_text()
        url = f"http://127.0.0.1:{mlflow_port}"
        assert not any(k in os.environ for k in KEYS if k.startswith("AWS_ACCESS"))  # this client holds no keys
        client = MlflowClient(url)
        run = client.create_run(client.create_experiment(f"s3-{uuid.uuid4().hex[:6]}")).info
        (tmp_path / "report.json").write_text('{"passed": true}')
        client.log_artifact(run.run_id, str(tmp_path / "report.json"), "gate")
        # a device's telemetry upload, through the proxy like any client
        rec = telemetry.Recorder(tmp_path / "device", ["a"], ["u"], "1", "dev-s3", rows_per_file=4)
        for i in range(4):
            rec.record(0, i, 1.7e9 + i, np.array([i], np.float32), np.array([0.5], np.float32), 1e-4, 0.02, 0)
        sent = rec.flush()
        data = sent.read_bytes()  # the upload removes the pending file
        (tele_run,) = telemetry.Uploader(tmp_path / "device", url, "s3-task", "dev-s3").upload()

        keys = {o["Key"] for o in boto3.client("s3", endpoint_url=endpoint, **_keys())
                .list_objects_v2(Bucket=bucket, Prefix="mlflow/").get("Contents", [])}
        assert any(k.endswith(f"{run.run_id}/artifacts/gate/report.json") for k in keys), keys
        assert any(k.endswith(f"{tele_run}/artifacts/telemetry/{sent.name}") for k in keys), keys
        back = Path(client.download_artifacts(tele_run, f"telemetry/{sent.name}", str(tmp_path / "back")))
        assert back.read_bytes() == data
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(30)


@pytest.mark.parametrize("uri, env, message", [
    ("gs://bucket/x", {}, r"--artifacts 'gs://bucket/x': give s3://BUCKET\[/PREFIX\]"),
    ("s3://No_Such", {}, r"'No_Such' is not an S3 bucket name"),
    ("s3://missing-bucket/p", {}, r"s3://missing-bucket/p at http://127.0.0.1:\d+: no such bucket"),
    ("BUCKET", {"MLFLOW_S3_ENDPOINT_URL": "http://127.0.0.1:9"}, r"at http://127.0.0.1:9: not reachable"),
])
def test_a_bad_artifact_store_is_one_line_before_anything_starts(s3, tmp_path, uri, env, message):
    endpoint, bucket = s3
    mlflow_port, prefect_port = free_port(), free_port()
    uri = f"s3://{bucket}/x" if uri == "BUCKET" else uri
    r = run_cli("sim2edge", "up", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                "--artifacts", uri, env={**_env(tmp_path / "home", endpoint), **env, "COLUMNS": "250"})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stdout + r.stderr
    assert re.search(message, lines[0]), lines[0]
    assert none_left(tmp_path / "home") and not (tmp_path / "home" / "logs" / "mlflow.log").exists()
