"""Which device runs which version, and how its control loop keeps time: the reports that the agent
leaves on the registered models (edge/report.py writes them, JSON in one tag each:
``sim2edge.device.<id>`` from ``sim2edge-agent watch``, ``sim2edge.control.<id>`` from ``run``)."""

from __future__ import annotations

import json
import time

from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict

from edge.report import CONTROL_PREFIX, TAG_PREFIX


class DeviceState(BaseModel):
    """One device's last reports. ``age_s``: seconds since the newer of them was sent (as of the read);
    ``health`` is None when only ``run`` reports; ``labels``: ``sim2edge-agent watch --label``; ``control`` is ``ControlLoop.stats()`` as ``run`` sent it."""

    model_config = ConfigDict(frozen=True)
    model: str
    device: str
    hostname: str | None = None
    policy: str | None = None
    version: str | None = None
    health: str | None = None
    runtime: str | None = None
    last_error: dict | None = None
    pull_failures: int = 0
    missed_reports: int = 0
    labels: dict[str, str] = {}
    control: dict | None = None
    time: float
    age_s: float


def _parse(model: str, key: str, value: str) -> dict:
    try:
        state = json.loads(value)
        float(state["time"]), str(state["device"])
        return state
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"registered model {model!r}: tag {key!r} is not a device state report "
                         f"({type(e).__name__}: {str(e)[:200]})") from None


def devices(client: MlflowClient, model: str | None = None) -> list[DeviceState]:
    """The devices reporting on ``model`` (every registered model if None), sorted by model and device tag."""
    models = [client.get_registered_model(model)] if model else client.search_registered_models()
    now = time.time()
    found = []
    for rm in models:
        by_id: dict[str, dict] = {}
        for key, value in sorted(rm.tags.items()):
            for prefix, kind in ((TAG_PREFIX, "device"), (CONTROL_PREFIX, "control")):
                if key.startswith(prefix):
                    by_id.setdefault(key[len(prefix):], {})[kind] = _parse(rm.name, key, value)
        for reports in by_id.values():
            device, control = reports.get("device", {}), reports.get("control")
            newest = max(float(r["time"]) for r in reports.values())
            fields = {k: v for k, v in device.items() if k in DeviceState.model_fields and k != "control"}
            if control is not None:
                fields.setdefault("device", control["device"])
                fields.setdefault("hostname", control.get("hostname"))
                fields.setdefault("policy", control.get("policy"))
                fields.setdefault("version", control.get("version"))
            found.append(DeviceState(**dict(fields, model=rm.name, time=newest, age_s=round(now - newest, 1),
                                            control=control)))
    return found
