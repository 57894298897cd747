"""The device's state, reported to the registry by ``watch``: which version runs here, and how well.

Where: one tag per device on the registered model it watches, ``sim2edge.device.<device id>``
(characters other than letters, digits, ``_ . -`` become ``_``), overwritten by each report;
its value is JSON::

    {"device": "jetson-7", "hostname": "jetson-7", "policy": "cartpole", "version": "3",
     "health": "ok", "runtime": "onnxruntime (CPUExecutionProvider)",
     "last_error": {"event": "refused", "check": "hash", "detail": "…", "time": 1764756000.1},
     "pull_failures": 0, "missed_reports": 0, "time": 1764756060.2,
     "last_refusal": {"policy": "cartpole", "version": "4", "bundle_sha256": "…", "check": "health",
                      "detail": "…", "time": 1764755000.0, "count": 1}}

``last_refusal``: the newest entry of ``<root>/failed.json``, a version the agent will not download
again until its bundle digest changes (null when there is none).

``health``: ``ok`` (the active bundle verifies against the pinned keys), ``corrupt`` (it does not;
``last_error`` says why), ``rolled-back`` (the last activation failed its health check and the
previous version runs again), ``none`` (no active policy). ``version`` is null without one.

REST (standard library, :class:`edge.registry_client.RegistryClient`):
``POST /api/2.0/mlflow/registered-models/set-tag`` ``{"name", "key", "value"}``.

A report never blocks the watch for long and never raises: one attempt with a short timeout; a
failure is counted in ``<root>/report.json`` and later reports are skipped until its backoff
expires. The state is computed afresh each time, so the next report that gets through carries the
current state and how many reports were missed.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from edge import bundle
from edge.errors import CheckFailed
from edge.registry_client import RegistryClient, TransferOptions
from edge.store import DeviceStore, write_atomic

TAG_PREFIX = "sim2edge.device."
_ERRORS = ("refused", "unavailable", "health-rollback")
_SWITCHES = ("activate", "rollback", "recovered", "health-rollback")


def tag_key(device_id: str) -> str:
    """The registered-model tag that holds ``device_id``'s state."""
    return TAG_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)[:200]


def _last(history: list, events: tuple) -> Optional[dict]:
    return next((e for e in reversed(history) if e["event"] in events), None)


def device_state(store: DeviceStore, trusted: Iterable, device_id: str) -> dict:
    """This device's state, from the store's links and journal (see the module docstring)."""
    history = store.history()
    current = store.link("current")
    error = _last(history, _ERRORS)
    last_error = {k: error[k] for k in ("event", "check", "detail", "time", "version") if k in error} if error else None
    health, runtime = "none", None
    if current is not None:
        try:
            bundle.verify_dir(current, trusted)
            switch = _last(history, _SWITCHES)
            health = "rolled-back" if switch and switch["event"] == "health-rollback" else "ok"
        except (CheckFailed, OSError, ValueError) as e:
            health, last_error = "corrupt", {"event": "verify", "detail": str(e), "time": time.time()}
        ran = _last([e for e in history if (e.get("policy"), str(e.get("version"))) == (current.parent.name,
                                                                                      current.name)],
                    ("activate", "rollback"))
        runtime = ran.get("runtime") if ran else None
    if last_error and "detail" in last_error:
        last_error["detail"] = str(last_error["detail"])[:500]
    backoff = store.backoff_state() or {}
    return {"device": device_id, "hostname": socket.gethostname(),
            "policy": current.parent.name if current else None, "version": current.name if current else None,
            "health": health, "runtime": runtime, "last_error": last_error,
            "pull_failures": int(backoff.get("failures", 0)), "time": round(time.time(), 3),
            "last_refusal": max(store.failed_versions().values(), key=lambda e: e.get("time", 0), default=None)}


class Reporter:
    """Sends :func:`device_state` to the registry, at most one short attempt per call (see the module docstring)."""

    def __init__(self, root: Path, registry_url: str, model: str, device_id: str, trusted: Iterable,
                 timeout_s: float = 5.0, backoff_base_s: float = 30.0, backoff_cap_s: float = 600.0) -> None:
        self.store = DeviceStore(root)
        self.path = Path(root) / "report.json"
        self.client = RegistryClient(registry_url, TransferOptions(attempts=1, timeout_s=timeout_s))
        self.model, self.device_id, self.trusted = model, device_id, list(trusted)
        self.base_s, self.cap_s = backoff_base_s, backoff_cap_s

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def report(self) -> Optional[dict]:
        """Report now unless backing off; returns the state sent, or None (skipped or failed). Never raises."""
        try:
            mark = self._load()
            missed = int(mark.get("missed", 0))
            if time.time() < float(mark.get("next_attempt", 0)):
                write_atomic(self.path, json.dumps(dict(mark, missed=missed + 1), sort_keys=True).encode())
                return None
            state = dict(device_state(self.store, self.trusted, self.device_id), missed_reports=missed)
            try:
                self.client._json("/api/2.0/mlflow/registered-models/set-tag", method="POST", body={
                    "name": self.model, "key": tag_key(self.device_id), "value": json.dumps(state, sort_keys=True)})
            except CheckFailed as e:
                failures = int(mark.get("failures", 0)) + 1
                delay = min(self.cap_s, self.base_s * 2 ** (failures - 1))
                write_atomic(self.path, json.dumps({"failures": failures, "missed": missed + 1, "last_error": e.detail,
                                                    "next_attempt": time.time() + delay}, sort_keys=True).encode())
                print(f"watch: state report failed ({e}); next try in {delay:.0f} s", file=sys.stderr, flush=True)
                return None
            write_atomic(self.path, json.dumps({"failures": 0, "missed": 0, "last_report": state["time"]},
                                               sort_keys=True).encode())
            return state
        except Exception as e:  # a report must never stop the watch
            print(f"watch: state report skipped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            return None
