"""Pull + verify + install of a 1 MB bundle from a local MLflow server, and the re-pull no-op.

Targets (issue 7): pull ≤ 2 s; re-pull of the active version ≤ 0.3 s. References measured in the
same run: one plain GET of the same artifact through the artifact proxy (the transfer alone), and
one plain GET of the alias (the registry round trip alone). Each measurement: median of N runs,
in process (``edge.pull.pull``) and through the console script (interpreter start included).

Run: .venv/bin/python benchmarks/agent_pull.py [--runs N]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge import signing  # noqa: E402
from edge.pull import pull  # noqa: E402
from flows import services  # noqa: E402
from flows.workspace import Workspace  # noqa: E402
from tests.bundles import make_bundle, make_keys, publish  # noqa: E402
from tests.conftest import free_port  # noqa: E402


def median(xs: list) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    runs = ap.parse_args().runs
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ws = Workspace(home=tmp)
    server = services.start(ws, "mlflow", services.mlflow_command(ws, "127.0.0.1", port), url, "/health",
                            tmp / "mlflow.log")
    try:
        services.wait_healthy([server], timeout_s=180)
        priv, pub = make_keys(tmp)
        tar = tmp / "bench-1.tar"
        make_bundle(tar, priv, version="1", name="bench", pad_bytes=1_000_000)
        publish(url, tar, "bench", "champion")
        size = tar.stat().st_size
        trusted = signing.load_trusted([pub])
        from edge.registry_client import RegistryClient
        ref = RegistryClient(url).resolve("bench@champion")
        art = f"{url}/api/2.0/mlflow-artifacts/artifacts/{ref.path}"
        alias = f"{url}/api/2.0/mlflow/registered-models/alias?name=bench&alias=champion"

        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        raw_get = median([timed(lambda: urllib.request.urlopen(art).read()) for _ in range(runs)])
        raw_alias = median([timed(lambda: urllib.request.urlopen(alias).read()) for _ in range(runs)])
        fresh, noop = [], []
        for i in range(runs):
            root = tmp / f"store-{i}"
            fresh.append(timed(lambda: pull("bench@champion", url, root, trusted, skip_target_check=True)))
            noop.append(timed(lambda: pull("bench@champion", url, root, trusted, skip_target_check=True)))
        agent = str(Path(sys.executable).parent / "sim2edge-agent")
        cli_fresh, cli_noop = [], []
        for i in range(max(3, runs // 2)):
            root = tmp / f"cli-{i}"
            cmd = [agent, "pull", "bench@champion", "--registry", url, "--root", str(root), "--trust", str(pub),
                   "--skip-target-check"]
            cli_fresh.append(timed(lambda: subprocess.run(cmd, check=True, capture_output=True)))
            cli_noop.append(timed(lambda: subprocess.run(cmd, check=True, capture_output=True)))
        print(f"bundle {size / 1e6:.2f} MB, median of {runs} runs")
        print(f"reference: plain GET of the bundle          {raw_get * 1e3:8.1f} ms")
        print(f"reference: plain GET of the alias           {raw_alias * 1e3:8.1f} ms")
        print(f"pull+verify+smoke+install+activate (in-process) {median(fresh) * 1e3:8.1f} ms  "
              f"= {median(fresh) / raw_get:.1f}x the plain GET   target <= 2000 ms")
        print(f"re-pull of the active version (in-process)      {median(noop) * 1e3:8.1f} ms  "
              f"= {median(noop) / raw_alias:.1f}x the alias GET  target <= 300 ms")
        print(f"pull via the console script (interpreter start incl.) {median(cli_fresh) * 1e3:8.1f} ms")
        print(f"re-pull via the console script                        {median(cli_noop) * 1e3:8.1f} ms")
    finally:
        services.stop([server])
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
