"""Deployments: `sim2edge deploy` registers prefect.yaml's two deployments with the nightly cron and timezone."""

from __future__ import annotations

import asyncio

from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

from flows.deployments import ONE_AT_A_TIME, deployments
from stages.sim.registry import names
from tests.conftest import run_cli


async def _deployments() -> dict:
    async with get_client() as client:
        return {d.name: d for d in await client.read_deployments()}


def test_deploy_registers_both_with_the_nightly_schedule(prefect_harness, tmp_path):
    env = {"PREFECT_API_URL": PREFECT_API_URL.value(), "SIM2EDGE_HOME": str(tmp_path)}
    out = run_cli("sim2edge", "deploy", "--pool", "test-pool", "--timezone", "Europe/Berlin", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    found = asyncio.run(_deployments())
    nightly, manual = found["nightly-retrain"], found["sim-to-edge"]
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "Europe/Berlin"
    assert nightly.concurrency_limit == 1 or nightly.global_concurrency_limit.limit == 1
    assert nightly.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    assert nightly.work_pool_name == manual.work_pool_name == "test-pool"
    assert manual.schedules == [] and nightly.entrypoint == "flows/nightly.py:nightly_retrain"
    task = manual.parameter_openapi_schema["definitions"]["SimToEdgeParams"]["properties"]["task"]
    assert task["enum"] == names() == ["arm6", "cartpole", "quadruped", "reacher"]  # the form's picker lists the registered tasks


def test_served_deployments_match_prefect_yaml():
    manual, nightly = deployments("Asia/Tokyo")
    assert manual.name == "sim-to-edge" and not manual.schedules
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "Asia/Tokyo"
    assert nightly.concurrency_limit == ONE_AT_A_TIME.limit == 1
    assert nightly.concurrency_options.collision_strategy == ONE_AT_A_TIME.collision_strategy
