"""Small real bundles for the agent's tests: a tiny ONNX graph built with onnx.helper, signed; publishing them
to a real MLflow server, and a fault-injecting proxy in front of it."""

from __future__ import annotations

import io
import socket
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from edge import bundle, signing


def tiny_onnx(weight: float = 0.5) -> bytes:
    """action = clip(obs @ W, -1, 1) with every weight ``weight``: (B, 5) → (B, 1)."""
    return linear_onnx(np.full((5, 1), weight, np.float32))


def linear_onnx(weights: np.ndarray) -> bytes:
    """action = clip(obs @ W, -1, 1): (B, obs) → (B, act) for W of shape (obs, act)."""
    n_obs, n_act = weights.shape
    w = numpy_helper.from_array(np.asarray(weights, np.float32), "W")
    lo, hi = (numpy_helper.from_array(np.array(v, np.float32), n) for v, n in ((-1.0, "lo"), (1.0, "hi")))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["obs", "W"], ["y"]), helper.make_node("Clip", ["y", "lo", "hi"], ["action"])],
        "tiny", [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", n_obs])],
        [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", n_act])], [w, lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def golden(weight: float = 0.5) -> bytes:
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, inputs=x, outputs=np.clip(x @ np.full((5, 1), weight, np.float32), -1, 1))
    return buf.getvalue()


def manifest(version: str = "1", target: str = "orin-jp6.1", period_s: float = 0.02, name: str = "tiny",
             io: dict | None = None) -> dict:
    """A hand-written manifest, only for tests that build deliberately malformed or foreign bundles (signed_tar);
    every genuine bundle comes from the real packager (:func:`make_bundle`)."""
    extra = {"io": io} if io is not None else {}
    return {
        **extra,
        "policy": {"name": name, "version": version, "task": "cartpole"},
        "provenance": {"mlflow_run_id": "test"},
        "target": {"name": target},
        "control": {"period_s": period_s},
        "runtime": {"onnxruntime_providers": ["CPUExecutionProvider"]},
        "parity_tolerance": {"fp32": {"atol": 1e-5, "rtol": 1e-4}},
    }


def make_keys(tmp: Path, name: str = "k") -> tuple[Path, Path]:
    priv, pub = tmp / f"{name}.key", tmp / f"{name}.pub"
    signing.generate_keypair(priv, pub)
    return priv, pub


DEFAULT_IO = {"input": {"terms": [{"name": n, "unit": "1"} for n in "abcde"]},
              "output": {"terms": [{"name": "u", "unit": "1"}], "low": [-1.0], "high": [1.0], "default": [0.0]}}
"""The contract of a bundle made without ``io``: five dimensionless inputs, one output in [-1, 1] (the graph's clip)."""

GATE_PASSED = {"success_rate": 0.95, "mean_return": 480.0, "episodes": 32, "passed": True, "twin": "calibrated twin"}
GATE_FAILED = {**GATE_PASSED, "success_rate": 0.4, "mean_return": 120.0, "passed": False}


def io_spec(io: dict, period_s: float, task: str = "cartpole"):
    """The :class:`stages.io_spec.IOSpec` a test's short ``io`` dict stands for (terms, output limits and default)."""
    from stages.io_spec import ActionTerm, IOSpec, ObservationTerm

    out = io["output"]
    actions = [ActionTerm(name=t["name"], unit=t["unit"], low=lo, high=hi, default=d)
               for t, lo, hi, d in zip(out["terms"], out["low"], out["high"], out["default"])]
    return IOSpec(task=task, observations=[ObservationTerm(name=t["name"], unit=t["unit"], source=t.get("source"))
                                           for t in io["input"]["terms"]],
                  actions=actions, control_period_s=period_s)


def make_bundle(out: Path, private_key: Path, files: dict | None = None, pad_bytes: int = 0, version: str = "1",
                target: str = "orin-jp6.1", period_s: float = 0.02, name: str = "tiny", io: dict | None = None,
                evaluation: dict | None = GATE_PASSED) -> str:
    """A tiny bundle written by the real packager (``stages.package``: manifest, annotated ONNX, Polygraphy
    files, signature) from a tiny ONNX graph; returns its sha256. ``files`` replaces ``policy.onnx`` and
    ``golden.npz``; ``pad_bytes`` adds a prebuilt-engine member (``engines/pad-<onnx sha256>.plan``) to make
    it bigger; ``evaluation`` is the signed gate result (GATE_PASSED, GATE_FAILED, or None: none recorded)."""
    import os
    import shutil
    import tempfile

    from stages.artifacts import ExportedPolicy
    from stages.package import PackageConfig, build_manifest, package

    files = files if files is not None else {"policy.onnx": tiny_onnx(), "golden.npz": golden()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "policy.onnx").write_bytes(files["policy.onnx"])
        (work / "golden.npz").write_bytes(files["golden.npz"])
        exported = ExportedPolicy(path=work / "policy.onnx", digest=bundle.sha256_path(work / "policy.onnx"),
                                  task="cartpole", opset=17, parity_max_abs_error=0.0, golden=work / "golden.npz")
        engines = []
        if pad_bytes:
            engines.append(work / f"pad-{exported.digest[:16]}.plan")
            engines[0].write_bytes(np.random.default_rng(len(out.name)).bytes(pad_bytes))
        (work / "keys").mkdir()
        shutil.copyfile(private_key, work / "keys" / "signing.key")
        cfg = PackageConfig(target=target)
        spec = io_spec(io if io is not None else DEFAULT_IO, period_s)
        m = build_manifest(cfg, name, version, exported, spec, {"mlflow_run_id": "test"}, evaluation)
        saved = os.environ.pop(signing.ENV_KEY, None)  # the test's key, not a signing key of the environment
        try:
            return package(cfg, m, exported, work / "keys", out, engines).digest
        finally:
            if saved is not None:
                os.environ[signing.ENV_KEY] = saved


TINY_IO = {"input": {"terms": [{"name": n, "unit": "1"} for n in "abcde"]},
           "output": {"terms": [{"name": "u", "unit": "N"}], "low": [-0.5], "high": [0.8], "default": [0.1]}}
COMMAND_IO = {**TINY_IO, "input": {"terms": [*TINY_IO["input"]["terms"][:3],
                                             *({"name": n, "unit": "m/s", "source": "command"} for n in "de")]}}
"""TINY_IO whose last two inputs, ``d`` and ``e``, are commands (``source: command``)."""


def signed_gate(tar: Path) -> bool:
    """Whether the bundle ``tar``'s signed manifest records a passed gate (True when it records none)."""
    import json
    import tarfile

    with tarfile.open(tar) as t:
        evaluation = json.loads(t.extractfile(bundle.MANIFEST).read()).get("evaluation") or {}
    return evaluation.get("passed", True) is not False


def log_bundle(client, tar: Path) -> tuple[str, str]:
    """Log ``tar`` as an artifact of a new run in the ``agent-tests`` experiment; returns (run id, proxy path)."""
    from registry import models

    found = client.get_experiment_by_name("agent-tests")
    exp = found.experiment_id if found else client.create_experiment("agent-tests")
    run = client.create_run(exp)
    client.log_artifact(run.info.run_id, str(tar), "bundle")
    client.set_terminated(run.info.run_id)
    return run.info.run_id, models.proxy_path(f"{run.info.artifact_uri}/bundle/{tar.name}", None)


def publish(tracking_url: str, tar: Path, name: str, alias: str | None = None) -> str:
    """Log ``tar`` on a real MLflow server and register it as the next version of ``name`` the way the pipeline
    does (``registry.models.reserve_version`` and ``publish``: the bundle tags the agent reads, the gate tag, and
    ``champion`` — moved when the signed gate passed — or ``challenger``); ``alias``, when given, is the alias
    it must have got. Returns the version number."""
    from mlflow.tracking import MlflowClient

    from registry import models

    client = MlflowClient(tracking_url)
    run_id, path = log_bundle(client, tar)
    version = models.reserve_version(client, name, run_id, f"runs:/{run_id}/bundle", {})
    got = models.publish(client, name, version, path, bundle.sha256_path(tar), tar.stat().st_size, signed_gate(tar),
                         {}, models.current_champion(client, name))
    assert alias is None or got == alias, f"{name} v{version} became {got}, not {alias}"
    return version


def publish_versions(tracking_url: str, tmp: Path, private_key: Path, name: str, count: int,
                     alias: str = "champion", **manifest_args) -> list[str]:
    """Publish versions 1..count of a tiny policy ``name`` (``alias`` on the last); returns the version numbers."""
    versions = []
    for i in range(1, count + 1):
        tar = tmp / f"{name}-{i}.tar"
        make_bundle(tar, private_key, version=str(i), name=name, **manifest_args)
        versions.append(publish(tracking_url, tar, name, alias if i == count else None))
    assert versions == [str(i) for i in range(1, count + 1)], f"{name} already had versions: {versions}"
    return versions


class FaultProxy:
    """A stdlib HTTP proxy in front of a real server that injects one queued fault per artifact download.

    ``faults`` is consumed in order, one per request to the artifact proxy (other requests pass through):
    ``"500"`` (server error), ``"drop"`` (half the body, then the connection is reset), ``"truncate"``
    (a consistent response of half the body), ``"oversize"`` (4 KiB more than the file, with a matching
    Content-Length), ``"oversize-nolength"`` (the same without Content-Length), ``"stall"`` (headers,
    then silence), ``"norange"`` (the Range header is stripped before forwarding). ``log`` records
    (path, Range sent by the client, status returned, fault) per artifact request.
    """

    def __init__(self, upstream: str, stall_s: float = 3.0) -> None:
        import http.server
        import threading
        import urllib.parse

        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults: list[str] = []
        self.log: list[tuple] = []
        self.requests = 0
        self.stall_s = stall_s
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.requests += 1
                artifact = "/mlflow-artifacts/artifacts/" in self.path
                fault = proxy.faults.pop(0) if artifact and proxy.faults else None
                if fault == "500":
                    proxy.log.append((self.path, self.headers.get("Range"), 500, fault))
                    body = b'{"error_code": "INTERNAL_ERROR", "message": "injected fault"}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                status, headers, body = proxy.forward(self.path, self.headers, strip_range=fault == "norange")
                if artifact:
                    proxy.log.append((self.path, self.headers.get("Range"), status, fault))
                if fault in ("oversize", "oversize-nolength"):
                    body += b"\0" * 4096
                if fault == "truncate":
                    body = body[: len(body) // 2]
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(k, v)
                if fault != "oversize-nolength":
                    self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                if fault == "stall":
                    time.sleep(proxy.stall_s)
                    return
                if fault == "drop":
                    # the connection ends halfway through a body whose Content-Length promised all of it
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def forward(self, path, headers, strip_range=False):
        import http.client

        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=30)
        try:
            keep = {k: v for k, v in headers.items() if k.lower() in ("authorization", "range", "accept")}
            if strip_range:
                keep = {k: v for k, v in keep.items() if k.lower() != "range"}
            conn.request("GET", path, headers=keep)
            r = conn.getresponse()
            return r.status, r.getheaders(), r.read()
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def active_store(tmp_path: Path, period_s: float = 0.02, io: dict = TINY_IO) -> Path:
    """A device store whose active policy is the tiny bundle with an I/O contract (``io``: TINY_IO, limits
    [-0.5, 0.8], default 0.1)."""
    from edge.store import DeviceStore

    priv, pub = make_keys(tmp_path)
    make_bundle(tmp_path / "b.tar", priv, io=io, period_s=period_s)
    store = DeviceStore(tmp_path / "store")
    staged = store.staging_dir()
    bundle.extract(tmp_path / "b.tar", staged, 1 << 24)
    bundle.verify_dir(staged, signing.load_trusted([pub]))
    store.activate(store.install(staged, "tiny", "1"))
    return store.root
