"""What a Python user passes to the registered policy through stock ``mlflow.pyfunc`` and ``mlflow models serve``:
float64 (plain floats, JSON), float32 and int columns act as the device runtime on the float32 values; a wrong
column set is refused naming the missing and extra columns. Each client is a fresh process with only stock MLflow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from edge.runtime import OnnxRuntime
from tests.conftest import free_port
from tests.test_mlflow_conformance import TERMS, register_tiny

NAME = "pyfunc-tiny"
MODEL_URI = f"models:/{NAME}@champion"
INTS = np.arange(-2, 3)[None, :] + np.arange(4)[:, None]

CLIENT = """
import json, sys
import mlflow, numpy as np, pandas as pd

terms, ints = json.loads(sys.argv[1]), np.array(json.loads(sys.argv[3]))
obs = np.array(json.loads(sys.argv[2]), np.float32)
inputs = {
    "float64": pd.DataFrame(obs.astype(np.float64), columns=terms)[terms[::-1]],
    "python_floats": pd.DataFrame(obs.tolist(), columns=terms),
    "float32": pd.DataFrame(obs, columns=terms),
    "int32": pd.DataFrame(ints.astype(np.int32), columns=terms),
    "int64_zero_one": pd.DataFrame(np.eye(5, dtype=np.int64), columns=terms),
    "int64": pd.DataFrame(ints.astype(np.int64), columns=terms),
    "numpy_named": pd.DataFrame(obs.astype(np.float64), columns=terms),
    "numpy": obs.astype(np.float64),
    "wrong_columns": pd.DataFrame(obs.astype(np.float64), columns=terms[:-1] + ["x"]),
}
model = mlflow.pyfunc.load_model(sys.argv[4])
result = {}
for name, data in inputs.items():
    try:
        result[name] = {"actions": model.predict(data)["action"].to_numpy().reshape(len(data), -1).tolist()}
    except mlflow.exceptions.MlflowException as e:
        result[name] = {"error": e.message}
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """A tiny champion in an embedded store (SQLite, file artifacts): the environment that names it, its graph."""
    tmp = tmp_path_factory.mktemp("pyfunc")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    weights = np.linspace(-0.4, 0.4, 5, dtype=np.float32).reshape(5, 1)
    onnx_path = register_tiny(MlflowClient(uri), tmp, NAME, weights, tmp / "artifacts")
    return dict(os.environ, MLFLOW_TRACKING_URI=uri), onnx_path


def device(onnx_path: Path, obs) -> np.ndarray:
    return OnnxRuntime(onnx_path).run(np.asarray(obs, np.float32))


def test_stock_pyfunc_takes_what_python_builds_and_acts_as_the_device(registry):
    env, onnx_path = registry
    obs = np.random.default_rng(5).normal(size=(6, 5)).astype(np.float32)
    done = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(TERMS), json.dumps(obs.tolist()),
                           json.dumps(INTS.tolist()), MODEL_URI], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])

    for name in ("float64", "python_floats", "float32", "numpy_named"):  # the same float32 values: the same numbers
        np.testing.assert_array_equal(result[name]["actions"], device(onnx_path, obs), err_msg=name)
    np.testing.assert_allclose(result["int32"]["actions"], device(onnx_path, INTS), atol=1e-6)
    np.testing.assert_allclose(result["int64_zero_one"]["actions"], device(onnx_path, np.eye(5)), atol=1e-6)
    # MLflow's own rules: int64 → double only for 0/1 values; a bare array has no names to match the terms by
    assert "Can not safely convert int64 to float64" in result["int64"]["error"]
    assert f"Model is missing inputs {TERMS}. Note that there were extra inputs: [0, 1, 2, 3, 4]." \
        in result["numpy"]["error"]
    assert "Model is missing inputs ['e']. Note that there were extra inputs: ['x']." \
        in result["wrong_columns"]["error"]


def test_mlflow_models_serve_answers_json_of_python_floats_as_the_device(registry, tmp_path):
    env, onnx_path = registry
    obs = np.random.default_rng(6).normal(size=(4, 5)).astype(np.float32)
    port, bin_dir = free_port(), Path(sys.executable).parent  # the server execs `uvicorn` from PATH
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen([str(bin_dir / "mlflow"), "models", "serve", "-m", MODEL_URI, "--env-manager",
                                   "local", "-h", "127.0.0.1", "-p", str(port)],
                                  env=dict(env, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}"), stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "mlflow models serve did not answer /ping in 120 s"
                time.sleep(0.5)
        answers = [invoke(url, rows) for rows in (obs.tolist(), INTS.tolist())]  # Python floats, then Python ints
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # its own session: the CLI and the uvicorn it started
            server.wait(timeout=30)
    np.testing.assert_allclose(answers[0], device(onnx_path, obs), atol=1e-6)
    np.testing.assert_allclose(answers[1], device(onnx_path, INTS), atol=1e-6)


def invoke(url: str, rows: list[list]) -> np.ndarray:
    """The server's actions for ``rows`` sent as ``dataframe_split`` JSON with the terms as columns."""
    body = json.dumps({"dataframe_split": {"columns": TERMS, "data": rows}}).encode()
    request = urllib.request.Request(f"{url}/invocations", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return np.array([row["action"] for row in json.loads(r.read())["predictions"]]).reshape(len(rows), -1)
