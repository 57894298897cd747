"""The device's state, reported to the registry by ``watch`` (which version runs here, and how well)
and by ``run`` (how its control loop keeps time).

Where: one tag per device on the registered model it watches, ``sim2edge.device.<device id>``
(characters other than letters, digits, ``_ . -`` become ``_``), overwritten by each report;
its value is JSON::

    {"device": "jetson-7", "hostname": "jetson-7", "policy": "cartpole", "version": "3", "labels": {"site": "lab-1"},
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

``run --registry URL --report-every S`` writes a second tag, ``sim2edge.control.<device id>``:
:meth:`edge.control.ControlLoop.stats` (counters since start; act() and wake-up percentiles over
the last ``--stats-window`` periods) plus ``device``, ``hostname``, ``time``, ``missed_reports``.

A report never blocks the agent for long and never raises: one attempt with a short timeout; a
failure is counted in ``<root>/report.json`` (``control-report.json`` for ``run``) and later
reports are skipped until its backoff expires. The state is computed afresh each time, so the
next report that gets through carries the current state and how many reports were missed.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

from edge import bundle
from edge.errors import CheckFailed
from edge.registry_client import RegistryClient, TransferOptions
from edge.store import DeviceStore, seconds_left, write_atomic

TAG_PREFIX = "sim2edge.device."
CONTROL_PREFIX = "sim2edge.control."
_ERRORS = ("refused", "unavailable", "health-rollback")
_SWITCHES = ("activate", "rollback", "recovered", "health-rollback")


def tag_key(device_id: str, prefix: str = TAG_PREFIX) -> str:
    """The registered-model tag that holds ``device_id``'s state (or, with ``CONTROL_PREFIX``, its control loop's)."""
    return prefix + re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)[:200]


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
    """Sends ``state()`` to the registry tag ``key``, at most one short attempt per call (see the module
    docstring); the backoff is kept in ``<root>/<mark>`` so a restarted agent honours it."""

    def __init__(self, root: Path, registry_url: str, model: str, key: str, state: Callable[[], dict],
                 mark: str = "report.json", label: str = "watch", timeout_s: float = 5.0,
                 backoff_base_s: float = 30.0, backoff_cap_s: float = 600.0) -> None:
        self.path = Path(root) / mark
        self.client = RegistryClient(registry_url, TransferOptions(attempts=1, timeout_s=timeout_s,
                                                                   deadline_s=2 * timeout_s))
        self.model, self.key, self.state, self.label = model, key, state, label
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
            now = time.time()
            last = float(mark.get("last_attempt", now))
            if seconds_left(last, float(mark.get("next_attempt", 0)), self.cap_s, now) and last <= now:
                write_atomic(self.path, json.dumps(dict(mark, missed=missed + 1), sort_keys=True).encode())
                return None
            state = dict(self.state(), missed_reports=missed)
            try:
                self.client._json("/api/2.0/mlflow/registered-models/set-tag", method="POST", body={
                    "name": self.model, "key": self.key, "value": json.dumps(state, sort_keys=True)})
            except CheckFailed as e:
                failures = int(mark.get("failures", 0)) + 1
                delay = min(self.cap_s, self.base_s * 2 ** (failures - 1))
                write_atomic(self.path, json.dumps({"failures": failures, "missed": missed + 1, "last_error": e.detail,
                                                    "last_attempt": now, "next_attempt": now + delay},
                                                   sort_keys=True).encode())
                print(f"{self.label}: state report failed ({e}); next try in {delay:.0f} s", file=sys.stderr,
                      flush=True)
                return None
            write_atomic(self.path, json.dumps({"failures": 0, "missed": 0, "last_report": state["time"]},
                                               sort_keys=True).encode())
            return state
        except Exception as e:  # a report must never stop the agent
            print(f"{self.label}: state report skipped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            return None


def device_reporter(root: Path, registry_url: str, model: str, device_id: str, trusted: Iterable,
                    timeout_s: float = 5.0, backoff_base_s: float = 30.0,
                    labels: Optional[Dict[str, str]] = None) -> Reporter:
    """``watch``'s reporter: :func:`device_state` (with ``labels``, ``--label``) to ``sim2edge.device.<id>``."""
    store, trusted = DeviceStore(root), list(trusted)
    return Reporter(root, registry_url, model, tag_key(device_id),
                    lambda: dict(device_state(store, trusted, device_id), labels=dict(labels or {})),
                    timeout_s=timeout_s, backoff_base_s=backoff_base_s)


def control_reporter(root: Path, registry_url: str, model: str, device_id: str, stats: Callable[[], dict],
                     timeout_s: float = 5.0, backoff_base_s: float = 30.0) -> Reporter:
    """``run``'s reporter: the control loop's statistics to ``sim2edge.control.<id>``."""
    def state() -> dict:
        return dict(stats(), device=device_id, hostname=socket.gethostname(), time=round(time.time(), 3))

    return Reporter(root, registry_url, model, tag_key(device_id, CONTROL_PREFIX), state, mark="control-report.json",
                    label="run", timeout_s=timeout_s, backoff_base_s=backoff_base_s)
