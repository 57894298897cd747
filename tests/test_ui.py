"""The Prefect UI as a user drives it: a real Prefect server, `sim2edge serve`, headless Chromium.

Clicks Run → Quick run on the `sim-to-edge` deployment, waits until the flow run shows
Completed, then checks the registered model version and its alias in MLflow.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows import services
from flows.workspace import Workspace
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ui]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory, mlflow_server):
    """A Prefect server on a free loopback port and `sim2edge serve` against it; yields the server URL."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (`apt-get install chromium`; make test does it as root)")
    home = tmp_path_factory.mktemp("ui-ws")
    ws = Workspace(home=home)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = services.start(ws, "prefect", services.prefect_command("127.0.0.1", port), url, "/api/health",
                            home / "prefect-server.log")
    env = {**os.environ, "PREFECT_API_URL": f"{url}/api", "SIM2EDGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server,
           "PREFECT_HOME": str(home / "serve-prefect")}
    serve = None
    try:
        services.wait_healthy([server])
        serve = subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "serve", "--timezone", "Europe/Berlin"],
                                 env=env, stdout=open(home / "serve.log", "wb"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.monotonic() + 120
        while len(api(f"{url}/api", "/deployments/filter")) < 2:
            assert serve.poll() is None and time.monotonic() < deadline, (home / "serve.log").read_text()[-3000:]
            time.sleep(1)
        yield url
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(timeout=30)
        services.stop([server])


def test_quick_run_from_the_ui_registers_a_model_version(served, mlflow_server, tmp_path):
    from playwright.sync_api import sync_playwright

    client = MlflowClient(mlflow_server)
    before = {v.version for v in client.search_model_versions("name='cartpole'")}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        try:
            page.goto(f"{served}/deployments", wait_until="networkidle")
            page.get_by_role("link", name="sim-to-edge", exact=True).first.click()
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Quick run", exact=True).click()
            deadline = time.monotonic() + 420
            runs = []
            while not runs and time.monotonic() < deadline:
                runs = api(f"{served}/api", "/flow_runs/filter", {"flows": {"name": {"any_": ["sim-to-edge"]}}})
                time.sleep(1)
            (run,) = runs  # the one run the click created
            run_id = run["id"]
            page.goto("about:blank")  # a live page's software rendering would compete with training for 2 cores
            while True:
                state = api(f"{served}/api", "/flow_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})[0]["state_type"]
                if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") or time.monotonic() > deadline:
                    break
                time.sleep(3)
            assert state == "COMPLETED", state
            page.goto(f"{served}/runs/flow-run/{run_id}")
            page.get_by_text("Completed").first.wait_for(timeout=30_000)
            page.screenshot(path=str(tmp_path / "flow-run.png"))
            # the run's summary artifact: gate verdicts as words, readable without an emoji font
            (artifact,) = api(f"{served}/api", "/artifacts/filter",
                              {"artifacts": {"key": {"any_": ["sim-to-edge-summary"]}},
                               "flow_runs": {"id": {"any_": [run_id]}}})
            page.goto(f"{served}/artifacts/artifact/{artifact['id']}")
            page.get_by_text("gate", exact=True).first.wait_for(timeout=30_000)
            text = page.inner_text("body")
            assert re.search(r"\bpass\b|\bFAIL\b", text) and "\u2705" not in text and "\u274c" not in text, text
        finally:
            page.screenshot(path=str(tmp_path / "last.png"))
            browser.close()
    new = {v.version for v in client.search_model_versions("name='cartpole'")} - before
    (version,) = new
    aliases = client.get_registered_model("cartpole").aliases
    assert version in aliases.values()
    assert client.get_model_version("cartpole", version).tags["sim2edge.bundle.sha256"]


def test_served_nightly_schedule_has_the_cron_and_timezone(served):
    found = {d["name"]: d for d in api(f"{served}/api", "/deployments/filter")}
    (schedule,) = found["nightly-retrain"]["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "Europe/Berlin"
    assert found["nightly-retrain"]["global_concurrency_limit"]["limit"] == 1
    assert found["nightly-retrain"]["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert found["sim-to-edge"]["schedules"] == []


def test_nightly_card_shows_its_time_and_timezone_in_the_browser(served, tmp_path):
    from playwright.sync_api import sync_playwright

    found = {d["name"]: d for d in api(f"{served}/api", "/deployments/filter")}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        try:
            page.goto(f"{served}/deployments/deployment/{found['nightly-retrain']['id']}", wait_until="networkidle")
            # Prefect's schedule chip shows no timezone ("At 02:00 AM every day"): the description says it
            page.get_by_text("Description", exact=True).first.click()
            page.get_by_text("Europe/Berlin", exact=False).first.wait_for(timeout=30_000)
            assert "02:00 Europe/Berlin" in page.inner_text("body")
        finally:
            page.screenshot(path=str(tmp_path / "nightly.png"))
            browser.close()
