"""The deployments: ``sim-to-edge`` (manual), ``nightly-retrain`` (cron, one at a time), ``rollout`` (manual,
one at a time: a staged rollout of a published version, ring by ring) and ``tune`` (manual, one at a time: an Optuna
search of a task's PPO settings).

``prefect.yaml`` declares the same four for a process work pool (``sim2edge deploy``);
``serve`` runs them from one process on a single machine (``sim2edge serve``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron

from flows.nightly import nightly_retrain
from flows.rollout import rollout
from flows.sim_to_edge import sim_to_edge
from flows.services import PrefectUnavailable, prefect_api
from flows.tune_flow import tune

NIGHTLY_CRON = "0 2 * * *"
ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
"""An overlapping nightly run is cancelled, never queued behind the running one: two cannot both promote. The same
for rollouts: a second one started while one runs is cancelled, not left to start by surprise later; and for
searches, which would share the machine's cores."""
ROLLOUT_DESCRIPTION = ("A staged rollout of one published version, ring by ring: halts and rolls back a failing ring; "
                       "one at a time.")
TUNE_DESCRIPTION = ("An Optuna search of a task's PPO settings, trials in parallel; the best written as a run "
                    "configuration. One at a time.")


def nightly_description(timezone: str = "UTC", cron: str = NIGHTLY_CRON) -> str:
    """The nightly deployment's description, which its card in the UI shows: the steps, and when, in which timezone."""
    fields = cron.split()
    daily = len(fields) == 5 and fields[0].isdigit() and fields[1].isdigit() and fields[2:] == ["*", "*", "*"]
    when = f"every day at {int(fields[1]):02d}:{int(fields[0]):02d} {timezone}" if daily else f"cron {cron} ({timezone})"
    return f"New telemetry → recalibrate → warm start → gate → package, {when}."


def deployments(timezone: str = "UTC", cron: str = NIGHTLY_CRON) -> list[RunnerDeployment]:
    return [
        sim_to_edge.to_deployment(name="sim-to-edge", description="The whole chain, triggered by hand from the UI.",
                                  tags=["sim2edge"]),
        nightly_retrain.to_deployment(name="nightly-retrain", schedules=[Cron(cron, timezone=timezone)],
                                      concurrency_limit=ONE_AT_A_TIME, tags=["sim2edge", "nightly"],
                                      description=nightly_description(timezone, cron)),
        rollout.to_deployment(name="rollout", description=ROLLOUT_DESCRIPTION, concurrency_limit=ONE_AT_A_TIME,
                              tags=["sim2edge", "fleet"]),
        tune.to_deployment(name="tune", description=TUNE_DESCRIPTION, concurrency_limit=ONE_AT_A_TIME,
                           tags=["sim2edge", "tune"]),
    ]


class OneLineDisconnects(logging.Filter):
    """Prefect logs a server that went away (a closed websocket, a refused connection) with a traceback;
    this keeps the log line and appends the exception's one-line summary instead."""

    def __init__(self, disconnects: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.disconnects = disconnects

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.disconnects):
            record.msg, record.args = f"{record.getMessage()} ({type(exc).__name__}: {exc})", None
            record.exc_info = record.exc_text = None
        return True


def serve(timezone: str = "UTC", cron: str = NIGHTLY_CRON) -> None:
    """Serve the deployments from this process until interrupted, on the running Prefect server
    (:func:`flows.services.prefect_api`); if it stops answering meanwhile (``sim2edge up`` stopped),
    the shutdown, which pauses the schedules on it, ends in :class:`flows.services.PrefectUnavailable`."""
    import httpx
    import websockets
    from prefect import serve as prefect_serve
    from prefect.logging.configuration import ensure_logging_setup

    api = prefect_api()
    ensure_logging_setup()
    for handler in logging.getLogger().handlers:
        handler.addFilter(OneLineDisconnects((OSError, httpx.TransportError, websockets.ConnectionClosed)))
    try:
        prefect_serve(*deployments(timezone, cron))
    except httpx.TransportError as e:
        raise PrefectUnavailable(f"the Prefect server at {api} stopped answering ({e}; was `sim2edge up` stopped?): "
                                 "stopped serving without pausing the schedules") from None


REPO = Path(__file__).resolve().parent.parent


def ensure_process_pool(name: str) -> None:
    """Create the process work pool ``name`` on the configured Prefect API if it does not exist."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pass


def deploy(pool: str, timezone: str) -> subprocess.CompletedProcess:
    """Register the deployments of ``prefect.yaml`` on ``pool`` with ``prefect deploy``, one by one
    (``prefect deploy --all`` ignores ``--pool`` and ``--timezone``); the nightly one's description names the timezone.
    Stops at the first that fails and returns its result."""
    ensure_process_pool(pool)
    base = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(REPO / "prefect.yaml"),
            "--pool", pool]
    for extra in (["--name", "sim-to-edge"], ["--name", "rollout"], ["--name", "tune"],
                  ["--name", "nightly-retrain", "--timezone", timezone, "--description", nightly_description(timezone)]):
        out = subprocess.run([*base, *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            break
    return out
