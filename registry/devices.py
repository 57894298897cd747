"""Which device runs which version: the state reports that ``sim2edge-agent watch`` leaves on the
registered models (edge/report.py writes them: one tag ``sim2edge.device.<id>`` per device, JSON)."""

from __future__ import annotations

import json
import time

from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict

from edge.report import TAG_PREFIX


class DeviceState(BaseModel):
    """One device's last report. ``age_s``: seconds since it was sent (as of the read)."""

    model_config = ConfigDict(frozen=True)
    model: str
    device: str
    hostname: str | None = None
    policy: str | None = None
    version: str | None = None
    health: str
    runtime: str | None = None
    last_error: dict | None = None
    pull_failures: int = 0
    missed_reports: int = 0
    time: float
    age_s: float


def devices(client: MlflowClient, model: str | None = None) -> list[DeviceState]:
    """The devices reporting on ``model`` (every registered model if None), sorted by model and device."""
    models = [client.get_registered_model(model)] if model else client.search_registered_models()
    now = time.time()
    found = []
    for rm in models:
        for key, value in sorted(rm.tags.items()):
            if not key.startswith(TAG_PREFIX):
                continue
            try:
                state = json.loads(value)
                found.append(DeviceState(model=rm.name, age_s=round(now - float(state["time"]), 1),
                                         **{k: v for k, v in state.items() if k in DeviceState.model_fields}))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"registered model {rm.name!r}: tag {key!r} is not a device state report "
                                 f"({type(e).__name__}: {str(e)[:200]})") from None
    return found
