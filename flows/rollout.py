"""``rollout``: a staged rollout of one published version, ring by ring (registry/rollout.py decides).

Every ``poll_s`` the flow applies an operator command (``sim2edge rollout pause|resume|abort`` leaves it in
``<state_dir>/<policy>.control``), reads the fleet's retained state reports from the MQTT broker, judges the
current ring, publishes the resulting plan as the signed ``<policy>/rollout.json`` when it changed, saves
the state (``<state_dir>/<policy>.json``, atomically) and shows the rings as a Prefect table artifact. A
broker that cannot be reached means no judgement that poll (devices keep what they run). Started again
after a crash, it resumes from the saved state and publishes the same plan, never a ring ahead."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from edge.store import write_atomic
from flows.artifact_keys import artifact_key
from registry.rollout import RolloutConfig, RolloutState, control, judge, plan, start


class RolloutParams(BaseModel):
    """One rollout: what and to whom (``config``), where devices read it, where the reports come from."""

    model_config = ConfigDict(frozen=True)
    config: RolloutConfig
    repo: Path = Field(description="The TUF repository the devices poll (sim2edge publish).")
    key_dir: Path = Field(description="Its role keys.")
    broker: str = Field(description="mqtt://HOST:PORT or mqtts:// the devices report to.")
    fleet: str = "default"
    mqtt_user: str = "sim2edge-reader"
    mqtt_password_file: Optional[Path] = Field(None, description="Default: $SIM2EDGE_MQTT_PASSWORD.")
    state_dir: Path
    poll_s: float = Field(30.0, gt=0)
    max_polls: Optional[int] = Field(None, ge=1, description="Stop after this many polls even if not ended.")


def state_file(state_dir: Path, policy: str) -> Path:
    return state_dir / f"{policy}.json"


def control_file(state_dir: Path, policy: str) -> Path:
    return state_dir / f"{policy}.control"


def load_state(state_dir: Path, policy: str) -> Optional[RolloutState]:
    path = state_file(state_dir, policy)
    return RolloutState.model_validate_json(path.read_text()) if path.exists() else None


def save_state(state_dir: Path, state: RolloutState) -> None:
    """Write the state atomically (a crash leaves the old one or the new one, never half)."""
    path = state_file(state_dir, state.config.policy)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, state.model_dump_json(indent=1).encode())


def take_command(state_dir: Path, policy: str) -> Optional[str]:
    """The operator's pending command, removed once read."""
    path = control_file(state_dir, policy)
    try:
        command = path.read_text().strip()
    except FileNotFoundError:
        return None
    path.unlink()
    return command


def publish_plan(params: RolloutParams, state: RolloutState) -> RolloutState:
    """Write the state's plan to the repository unless it is the one published last."""
    from registry.tuf_repo import RepoConfig, write_rollout

    wanted = plan(state)
    if wanted == state.published:
        return state
    write_rollout(RepoConfig(repo=params.repo, keys=params.key_dir), state.config.policy, wanted)
    return state.model_copy(update={"published": wanted})


def show(state: RolloutState) -> None:
    rows = [{"ring": r.name, "status": r.status, "admitted %": round(r.admitted, 3), "devices": r.devices,
             "succeeded": r.succeeded, "failed": r.failed, "timed out": r.timed_out,
             "failed devices": ", ".join(r.failed_devices), "reason": r.reason}
            for r in state.rings]
    create_table_artifact(key=artifact_key("rollout", state.config.policy), table=rows, description=f"{state.config.policy} v{state.config.version}: "
                                                           f"{state.status} {state.reason}".strip())


@flow(name="rollout", log_prints=True)
def rollout(params: RolloutParams) -> RolloutState:
    """Roll ``params.config.version`` out ring by ring until every ring passed, one halted, or it is aborted."""
    from edge.mqtt_report import read_password
    from registry.fleet_state import read_fleet

    cfg = params.config
    password = read_password(params.mqtt_password_file, dict(os.environ))
    state = load_state(params.state_dir, cfg.policy)
    if state is None or state.config != cfg:
        state = start(cfg, time.time())
    else:
        print(f"rollout {cfg.policy} v{cfg.version}: resuming at ring {state.rings[state.ring].name} ({state.status})")
    polls, shown = 0, None
    while True:
        command = take_command(params.state_dir, cfg.policy)
        if command:
            state = control(state, command, time.time())
        try:
            reports = read_fleet(params.broker, params.fleet, params.mqtt_user, password).devices
        except OSError as e:
            print(f"rollout {cfg.policy}: broker unavailable ({e}); nothing judged this poll")
            reports = None
        if reports is not None:
            state = judge(state, reports, time.time())
        state = publish_plan(params, state)
        save_state(params.state_dir, state)
        if state != shown:
            show(state)
            shown = state
            print(f"rollout {cfg.policy} v{cfg.version}: {state.status}, ring {state.rings[state.ring].name} "
                  f"{state.rings[state.ring].status} {state.reason}".rstrip())
        polls += 1
        if state.ended or (params.max_polls and polls >= params.max_polls):
            return state
        time.sleep(params.poll_s)
