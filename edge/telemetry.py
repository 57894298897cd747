"""Device telemetry: what the control loop saw and did, in rotating files under a disk cap, and its upload.

Files: ``<root>/telemetry/pending/<start ms>-<seq>-v<policy version>.npz``, one per
``rows_per_file`` control steps, written to a temporary name, fsynced and renamed. Each holds the
collect log format's columns (stages/logs.py) that the device itself knows, under the same names:
``episode``, ``step``, ``time``, ``obs.<name>``, ``act.<name>``, ``inference_ms``, ``loop_ms``,
``policy_version``, ``device_id``, plus ``flags`` (the wire format's action flags) and
``schema_version``. ``act.<name>`` is what the agent sent: the policy's actuator command (the
graph scales it; collect derives the log's ``ctrl.*`` and normalized ``act.*`` from it). When the
robot appends its measured joint state to observations (edge/control.py), it is recorded as
``state.<i>`` (NaN in rows that came without it); collect splits it into ``qpos.*``/``qvel.*``.

Why .npz, not Parquet: the agent may depend only on the standard library, numpy, an inference
runtime and cryptography; numpy writes .npz natively (uncompressed, no pickle: every column is a
plain numeric or unicode array), and the columns map one to one onto the Parquet log's columns.

``format="mcap"`` (``run --telemetry-format mcap``): the same rows, rotation and discipline, as ``.mcap``
files with ROS 2 message schemas (edge/telemetry_mcap.py) for Foxglove, ``ros2 bag`` and ``collect --source
rosbag``; it needs the ``mcap`` extra.

Disk cap: when the pending files reach ``cap_bytes`` the recorder stops writing and counts the
dropped rows; nothing is deleted before its upload is confirmed.

Upload (the contract of registry/telemetry.py, over REST with the standard library): per policy
version, one run in experiment ``sim2edge/telemetry`` tagged ``sim2edge.telemetry=true``,
``sim2edge.task``, ``sim2edge.device``, ``sim2edge.policy_version``, the files as artifacts under
``telemetry/``, then the run set FINISHED. ``<root>/telemetry/upload.json`` remembers the run and
the files confirmed (listed by the server with the right size), so an interrupted upload resumes
in the same run; local files are deleted only after the run is FINISHED.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
import urllib.parse
from pathlib import Path
from typing import IO, Dict, List, Optional

import numpy as np

from edge.store import DeviceStore, fsync_dir
from edge.errors import CheckFailed
from edge.registry_client import RegistryClient, RegistryError, TransferOptions
from edge.values import ID, ArtifactPath, shown


def answer_field(answer: object, keys: tuple, pattern: "re.Pattern[str]") -> str:
    """``answer[k0][k1]…`` as a string matching ``pattern``, or a refusal naming the field (check ``registry``)."""
    value = answer
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise CheckFailed("registry", f"the registry's answer has no valid {'.'.join(keys)}: {shown(value)}")
    return value

EXPERIMENT = "sim2edge/telemetry"
SCHEMA_VERSION = 1
FORMATS = ("npz", "mcap")


def _savez(f: IO[bytes], cols: Dict[str, np.ndarray]) -> None:
    np.savez(f, **cols)


class Recorder:
    """Buffers one row per control step; writes a file every ``rows_per_file`` rows (and on close)."""

    def __init__(self, root: Path, obs_names: List[str], act_names: List[str], policy_version: str,
                 device_id: str, rows_per_file: int = 3000, cap_bytes: int = 256 << 20, format: str = "npz",
                 joint_names: Optional[List[str]] = None) -> None:
        """``joint_names``: the ROS joints whose positions then velocities the state holds, where known (MCAP's
        JointState names them; .npz keeps ``state.<i>``)."""
        if format not in FORMATS:
            raise CheckFailed("telemetry", f"format {shown(format)} is not one of {', '.join(FORMATS)}")
        self.format, self.write = format, _savez
        if format == "mcap":
            try:
                from edge import telemetry_mcap
            except ImportError as e:
                raise CheckFailed("telemetry", f"format mcap needs the mcap extra: pip install "
                                               f"'sim2edge-agent[mcap]' ({e})") from None
            self.write = functools.partial(telemetry_mcap.write, joint_names=joint_names)
        self.dir = DeviceStore(Path(root)).inside("telemetry", "pending")  # a link there is refused
        self.dir.mkdir(parents=True, exist_ok=True)
        self.obs_names, self.act_names = obs_names, act_names
        self.policy_version, self.device_id = policy_version, device_id
        self.rows, self.cap = rows_per_file, cap_bytes
        self.obs = np.zeros((rows_per_file, len(obs_names)), np.float32)
        self.act = np.zeros((rows_per_file, len(act_names)), np.float32)
        self.scalars = np.zeros((rows_per_file, 5), np.float64)  # episode, step, time, inference_ms, loop_ms
        self.flags = np.zeros(rows_per_file, np.uint32)
        self.state: Optional[np.ndarray] = None  # (rows, nstate), allocated with the first joint state seen
        self.n = 0
        self.seq = 0
        self.files_written = 0
        self.rows_dropped = 0

    def record(self, episode: int, step: int, t: float, obs: np.ndarray, act: np.ndarray,
               inference_s: float, loop_s: float, flags: int, state: Optional[np.ndarray] = None) -> None:
        i = self.n
        self.obs[i], self.act[i] = obs, act
        if state is not None and self.state is None:
            self.state = np.full((self.rows, len(state)), np.nan, np.float32)
        if self.state is not None:
            self.state[i] = np.nan if state is None else state
        self.scalars[i] = (episode, step, t, inference_s * 1e3, loop_s * 1e3)
        self.flags[i] = flags
        self.n += 1
        if self.n == self.rows:
            self.flush()

    def pending_bytes(self) -> int:
        return sum(p.stat().st_size for p in pending(self.dir))

    def flush(self) -> Optional[Path]:
        """Write the buffered rows to a new file (unless over the disk cap); returns its path."""
        n, self.n = self.n, 0
        if n == 0:
            return None
        if self.pending_bytes() >= self.cap:
            self.rows_dropped += n
            return None
        cols: Dict[str, np.ndarray] = {
            "schema_version": np.array(SCHEMA_VERSION),
            "episode": self.scalars[:n, 0].astype(np.int64), "step": self.scalars[:n, 1].astype(np.int64),
            "time": self.scalars[:n, 2].copy(),
            "inference_ms": self.scalars[:n, 3].astype(np.float32), "loop_ms": self.scalars[:n, 4].astype(np.float32),
            "flags": self.flags[:n].copy(),
            "policy_version": np.array([self.policy_version] * n), "device_id": np.array([self.device_id] * n),
        }
        cols.update({f"obs.{name}": self.obs[:n, j].copy() for j, name in enumerate(self.obs_names)})
        cols.update({f"act.{name}": self.act[:n, j].copy() for j, name in enumerate(self.act_names)})
        if self.state is not None:
            cols.update({f"state.{j}": self.state[:n, j].copy() for j in range(self.state.shape[1])})
            self.state[:] = np.nan
        name = f"{int(time.time() * 1000)}-{self.seq:06d}-v{self.policy_version}.{self.format}"
        self.seq += 1
        tmp = self.dir / f".{name}.tmp"
        with open(tmp, "wb") as f:
            self.write(f, cols)
            f.flush()
            os.fsync(f.fileno())
        os.replace(str(tmp), str(self.dir / name))
        fsync_dir(self.dir)
        self.files_written += 1
        return self.dir / name


def pending(folder: Path) -> List[Path]:
    """The telemetry files in ``folder`` (either format), by name."""
    return sorted(p for fmt in FORMATS for p in folder.glob(f"*.{fmt}"))


def read(path: Path) -> Dict[str, np.ndarray]:
    """A telemetry file's columns (no pickle)."""
    with np.load(path, allow_pickle=False) as z:
        cols = {k: z[k] for k in z.files}
    if int(cols.get("schema_version", -1)) != SCHEMA_VERSION:
        raise ValueError(f"{path}: telemetry schema version {cols.get('schema_version')} is not {SCHEMA_VERSION}")
    return cols


class Uploader:
    """Sends pending telemetry files to the registry, resumably (see the module docstring)."""

    def __init__(self, root: Path, registry_url: str, task: str, device_id: str,
                 options: Optional[TransferOptions] = None) -> None:
        self.dir = Path(root) / "telemetry" / "pending"
        self.state_path = Path(root) / "telemetry" / "upload.json"
        self.client = RegistryClient(registry_url, options)
        self.task, self.device_id = task, device_id

    def _state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self, state: dict) -> None:
        tmp = self.state_path.with_name(".upload.json.tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(str(tmp), str(self.state_path))

    def _experiment_id(self) -> str:
        try:
            answer = self.client._json("/api/2.0/mlflow/experiments/get-by-name", {"experiment_name": EXPERIMENT})
            return answer_field(answer, ("experiment", "experiment_id"), ID)
        except RegistryError as e:
            if e.status != 404:
                raise
        try:
            answer = self.client._json("/api/2.0/mlflow/experiments/create", method="POST", body={"name": EXPERIMENT})
            return answer_field(answer, ("experiment_id",), ID)
        except RegistryError as e:  # created meanwhile by another device
            if "RESOURCE_ALREADY_EXISTS" not in e.detail and e.status != 400:
                raise
            return self._experiment_id()

    def _start_run(self, version: str) -> dict:
        tags = {"sim2edge.telemetry": "true", "sim2edge.task": self.task, "sim2edge.device": self.device_id,
                "sim2edge.policy_version": version, "mlflow.runName": f"telemetry {self.device_id}"}
        run = self.client._json("/api/2.0/mlflow/runs/create", method="POST", body={
            "experiment_id": self._experiment_id(), "start_time": int(time.time() * 1000),
            "run_name": f"telemetry {self.device_id}", "tags": [{"key": k, "value": v} for k, v in tags.items()]})
        uri = answer_field(run, ("run", "info", "artifact_uri"), re.compile(r".{1,2048}"))
        if not uri.startswith("mlflow-artifacts:"):
            raise RegistryError(f"telemetry run artifacts live at {uri}, not behind the artifact proxy "
                                f"(start the server with --serve-artifacts)", 0)
        artifacts = ArtifactPath.parse(uri.split(":", 1)[1].lstrip("/"), "run.info.artifact_uri")
        return {"run_id": answer_field(run, ("run", "info", "run_id"), ID), "artifacts": artifacts + "/telemetry",
                "version": version, "confirmed": []}

    def _listed_sizes(self, artifacts: str) -> Dict[str, int]:
        """What the artifact proxy lists under ``artifacts``: file name → size (entries it cannot size: -1)."""
        listing = self.client._json("/api/2.0/mlflow-artifacts/artifacts", {"path": artifacts})
        files = listing.get("files", [])
        sizes = {}
        for f in files if isinstance(files, list) else []:
            if isinstance(f, dict) and isinstance(f.get("path"), str):
                size = f.get("file_size", -1)
                sizes[f["path"].rsplit("/", 1)[-1]] = size if isinstance(size, int) and not isinstance(size, bool) else -1
        return sizes

    def upload(self, stop_after: Optional[int] = None) -> List[str]:
        """Upload every pending file; returns the run ids finished. ``stop_after`` files: stop early (tests)."""
        finished, sent = [], 0
        while True:
            files = pending(self.dir)
            state = self._state()
            if not state:
                if not files:
                    return finished
                version = files[0].stem.rsplit("-v", 1)[-1]
                state = self._start_run(version)
                self._save(state)
            batch = [f for f in files if f.stem.rsplit("-v", 1)[-1] == state["version"]]
            for f in batch:
                if f.name in state["confirmed"]:
                    continue
                if stop_after is not None and sent >= stop_after:
                    return finished
                path = "/api/2.0/mlflow-artifacts/artifacts/" + urllib.parse.quote(f"{state['artifacts']}/{f.name}")
                self.client._json(path, method="PUT", raw=f.read_bytes())
                sent += 1
                if self._listed_sizes(state["artifacts"]).get(f.name) != f.stat().st_size:
                    raise RegistryError(f"{f.name} is not listed with its {f.stat().st_size} bytes after upload", 0)
                state["confirmed"].append(f.name)
                self._save(state)
            self.client._json("/api/2.0/mlflow/runs/update", method="POST", body={
                "run_id": state["run_id"], "status": "FINISHED", "end_time": int(time.time() * 1000)})
            for f in batch:  # confirmed and the run finished: only now are the local copies removed
                f.unlink()
            self.state_path.unlink()
            finished.append(state["run_id"])
