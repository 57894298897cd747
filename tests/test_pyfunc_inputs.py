"""What a Python user passes to the registered policy through stock ``mlflow.pyfunc`` and ``mlflow models serve``:
float64 (plain floats, JSON), float32, int and bool columns, arrays and lists of rows act as the device runtime on
the float32 values; a wrong column set, a wrong width, an int float32 cannot hold, a NaN or a string is refused in
one line naming it. Each client is a fresh process with only stock MLflow.
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
    "numpy_int64": ints.astype(np.int64),
    "rows": obs.tolist(),
    "unnamed_frame": pd.DataFrame(obs.astype(np.float64)),
    "dict": {t: obs[:, i].astype(np.float64).tolist() for i, t in enumerate(terms)},
    "bool": pd.DataFrame(np.eye(5, dtype=bool), columns=terms),
    "wrong_columns": pd.DataFrame(obs.astype(np.float64), columns=terms[:-1] + ["x"]),
    "wrong_width": obs[:, :4].astype(np.float64),
    "int_too_big": pd.DataFrame(ints.astype(np.int64) + 2 ** 24, columns=terms),
    "nan": pd.DataFrame(np.where(np.eye(len(obs), 5, 2) > 0, np.nan, obs.astype(np.float64)), columns=terms),
    "string": pd.DataFrame(obs.astype(np.float64), columns=terms).astype({terms[1]: str}).assign(**{terms[1]: "x"}),
}
model = mlflow.pyfunc.load_model(sys.argv[4])
result = {}
for name, data in inputs.items():
    try:
        result[name] = {"actions": model.predict(data)["action"].to_numpy().reshape(-1, 1).tolist()}  # one action
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

    for name in ("float64", "python_floats", "float32", "numpy_named", "numpy", "rows", "unnamed_frame", "dict"):
        np.testing.assert_array_equal(result[name]["actions"], device(onnx_path, obs), err_msg=name)  # same numbers
    for name in ("int32", "int64", "numpy_int64"):
        np.testing.assert_array_equal(result[name]["actions"], device(onnx_path, INTS), err_msg=name)
    for name in ("int64_zero_one", "bool"):
        np.testing.assert_array_equal(result[name]["actions"], device(onnx_path, np.eye(5)), err_msg=name)
    refusals = {"wrong_columns": f"policy input: missing terms ['e'], extra columns ['x']; the terms are {TERMS}",
                "wrong_width": "policy input: an array of shape (6, 4) given; it needs one column per term, (rows, 5)",
                "int_too_big": "policy input: column 'a' holds 16777217, beyond the integers float32 holds exactly",
                "nan": "policy input: column 'c' row 0 is nan, not a finite float32",
                "string": "policy input: column 'b' is not numeric (first value 'x')"}
    for name, message in refusals.items():
        assert message in result[name]["error"] and "\n" not in result[name]["error"], (name, result[name])


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
        answers.append(invoke_inputs(url, obs.tolist()))  # rows without names, in the policy's order
        refusal = invoke_inputs(url, obs[:, :4].tolist())
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # its own session: the CLI and the uvicorn it started
            server.wait(timeout=30)
    np.testing.assert_allclose(answers[0], device(onnx_path, obs), atol=1e-6)
    np.testing.assert_allclose(answers[1], device(onnx_path, INTS), atol=1e-6)
    np.testing.assert_allclose(answers[2], device(onnx_path, obs), atol=1e-6)
    status, message = refusal  # the scoring server puts the data before the loader's line
    assert status == 400 and message.endswith("Error: policy input: an array of shape (4, 4) given; it needs one "
                                              f"column per term, (rows, 5), in the order {TERMS}")


def invoke(url: str, rows: list[list]) -> np.ndarray:
    """The server's actions for ``rows`` sent as ``dataframe_split`` JSON with the terms as columns."""
    answer = post(url, {"dataframe_split": {"columns": TERMS, "data": rows}})
    return np.array([row["action"] for row in answer["predictions"]]).reshape(len(rows), -1)


def invoke_inputs(url: str, rows: list[list]) -> np.ndarray | tuple[int, str]:
    """The server's actions for ``rows`` sent as a bare ``inputs`` array, or its error status and message."""
    try:
        answer = post(url, {"inputs": rows})
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["message"]
    return np.array([row["action"] for row in answer["predictions"]]).reshape(len(rows), -1)


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())
