"""The two deployments: ``sim-to-edge`` (manual) and ``nightly-retrain`` (cron, one at a time).

``prefect.yaml`` declares the same two for a process work pool (``sim2edge deploy``);
``serve`` runs both from one process on a single machine (``sim2edge serve``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron

from flows.nightly import nightly_retrain
from flows.sim_to_edge import sim_to_edge

NIGHTLY_CRON = "0 2 * * *"
ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
"""An overlapping nightly run is cancelled, never queued behind the running one: two cannot both promote."""


def deployments(timezone: str = "UTC", cron: str = NIGHTLY_CRON) -> list[RunnerDeployment]:
    return [
        sim_to_edge.to_deployment(name="sim-to-edge", description="The whole chain, triggered by hand from the UI.",
                                  tags=["sim2edge"]),
        nightly_retrain.to_deployment(name="nightly-retrain", schedules=[Cron(cron, timezone=timezone)],
                                      concurrency_limit=ONE_AT_A_TIME, tags=["sim2edge", "nightly"],
                                      description="New telemetry → recalibrate → warm start → gate → package."),
    ]


def serve(timezone: str = "UTC", cron: str = NIGHTLY_CRON) -> None:
    """Serve both deployments from this process until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(timezone, cron))


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
    """Register both deployments of ``prefect.yaml`` on ``pool`` with ``prefect deploy``, one by one
    (``prefect deploy --all`` ignores ``--pool`` and ``--timezone``)."""
    ensure_process_pool(pool)
    base = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(REPO / "prefect.yaml"),
            "--pool", pool]
    out = subprocess.run([*base, "--name", "sim-to-edge"], cwd=REPO, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return out
    return subprocess.run([*base, "--name", "nightly-retrain", "--timezone", timezone], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
