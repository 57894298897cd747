"""The team stack's tracking server on SQLite against PostgreSQL (issue 35): one MLflow server each (the command of
``sim2edge up``: one worker, artifacts behind its proxy), on the workspace's SQLite file and on Debian's PostgreSQL
started here as this process's own server, as tests/test_up_postgres.py does (needs root, to run it as the
postgres user). N concurrent clients (separate processes) each log runs as a pipeline run does, over MLflow's REST
API without retries: create the run with its tags, one batch of params and tags, three metrics, finish it. Both
servers run at once and each N is measured on SQLite then PostgreSQL, back to back.

Prints per backend and N: requests/s, runs/s, p50/p99 latency of a request, the errors (and the first of each
kind), then PostgreSQL/SQLite ratios measured in the same run. 20 clients work too: a failed request is counted
and its reason shown (SQLite's "database is locked" would show there), never retried.

``--pipeline`` adds, in the same run, one ``sim2edge run`` of the tiny configuration of tests/test_team_runs.py (its
cart-pole that always passes the gate) against ``sim2edge up`` on SQLite, then ``sim2edge up --database
postgresql://…`` on the same PostgreSQL server, pointed at them as that test does (``MLFLOW_TRACKING_URI``,
``PREFECT_API_URL``): the run's wall time, each stage's seconds (its ``seconds.*`` metrics, read back from MLflow)
and the PostgreSQL/SQLite ratios. Each run starts from a fresh workspace (no stage cache), as a new laptop would.

``--pipeline-runs K`` makes it K runs each, alternating between the backends (both stacks up at once), medians.

Run: .venv/bin/python benchmarks/team_backends.py [--clients 1 4 8 --seconds 8] [--pipeline [--pipeline-runs K]]"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows import services, team_database  # noqa: E402
from flows.workspace import Workspace  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.test_up_postgres import PG_BIN, as_postgres  # noqa: E402

PARAMS = {f"train.param_{i}": str(i) for i in range(12)}
TAGS = {"sim2edge.stage": "train", "sim2edge.task": "cartpole", "sim2edge.policy": "bench", "sim2edge.git": "0" * 40}


def start_postgres(root: Path) -> int:
    """A PostgreSQL server of this process's own on a loopback port (trust auth, socket in ``root``)."""
    shutil.chown(root, "postgres", "postgres")
    port = free_port()
    for cmd in ([str(PG_BIN / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres", "--no-sync"],
                [str(PG_BIN / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "server.log"), "-w", "-o",
                 f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start"]):
        done = as_postgres(*cmd)
        if done.returncode != 0:
            raise SystemExit(f"postgres: {' '.join(cmd[:1])} failed: {done.stderr.strip()}")
    return port


def one_run(session, api: str, experiment: str, timings: list[float], errors: Counter) -> bool:
    """A pipeline run's writes; each request's seconds into ``timings``, a failed one's reason into ``errors``."""

    def call(endpoint: str, body: dict) -> dict | None:
        t0 = time.perf_counter()
        try:
            r = session.post(f"{api}/{endpoint}", json=body, timeout=60)
            ok, reason = r.status_code == 200, f"HTTP {r.status_code}: {r.text[:160]}"
        except Exception as e:  # noqa: BLE001  (a refused or reset connection is a result here)
            ok, reason = False, f"{type(e).__name__}: {str(e)[:160]}"
        timings.append(time.perf_counter() - t0)
        if not ok:
            errors[reason] += 1
            return None
        return r.json()

    now = int(time.time() * 1000)
    created = call("runs/create", {"experiment_id": experiment, "start_time": now,
                                   "tags": [{"key": "sim2edge.run", "value": "bench"}]})
    if created is None:
        return False
    run = created["run"]["info"]["run_id"]
    steps = [call("runs/log-batch", {"run_id": run, "params": [{"key": k, "value": v} for k, v in PARAMS.items()],
                                     "tags": [{"key": k, "value": v} for k, v in TAGS.items()]})]
    steps += [call("runs/log-metric", {"run_id": run, "key": key, "value": 0.5, "timestamp": now, "step": 0})
              for key in ("train.return", "calibrate.gap", "evaluate.success_rate")]
    steps.append(call("runs/update", {"run_id": run, "status": "FINISHED", "end_time": int(time.time() * 1000)}))
    return all(s is not None for s in steps)


def client(api: str, experiment: str, start_at: float, seconds: float) -> tuple[int, list[float], Counter, float]:
    """One client process: runs back to back from ``start_at`` for ``seconds``; (runs completed, timings, errors,
    when its last run ended)."""
    import requests

    session, timings, errors, runs = requests.Session(), [], Counter(), 0
    time.sleep(max(0.0, start_at - time.time()))
    while time.time() < start_at + seconds:
        runs += one_run(session, api, experiment, timings, errors)
    return runs, timings, errors, time.time()


def measure(url: str, n: int, seconds: float) -> dict:
    """``n`` clients against the server at ``url`` for ``seconds``: throughput, latency and errors."""
    import requests

    api = f"{url}/api/2.0/mlflow"
    experiment = requests.post(f"{api}/experiments/create", json={"name": f"bench-{n}-{time.time_ns()}"},
                               timeout=60).json()["experiment_id"]
    with ProcessPoolExecutor(n) as pool:
        start_at = time.time() + 2  # every process started and waiting
        results = list(pool.map(client, [api] * n, [experiment] * n, [start_at] * n, [seconds] * n))
    timings = sorted(t for _, ts, _, _ in results for t in ts)
    errors = sum((e for _, _, e, _ in results), Counter())
    elapsed = max(end for *_, end in results) - start_at  # the last run started in the window is counted whole
    q = statistics.quantiles(timings, n=100)
    return {"clients": n, "requests_per_s": round((len(timings) - sum(errors.values())) / elapsed, 1),
            "runs_per_s": round(sum(r for r, *_ in results) / elapsed, 2), "p50_ms": round(q[49] * 1000, 1),
            "p99_ms": round(q[98] * 1000, 1), "requests": len(timings), "errors": sum(errors.values()),
            "first_errors": {k: v for k, v in errors.most_common(3)}}


def backends(stores: dict[str, tuple[Workspace, str | None]], clients: list[int], seconds: float) -> dict:
    """Start MLflow as ``sim2edge up`` does on each store (None: the workspace's SQLite), all at once; then for each N
    measure each backend in turn (SQLite, PostgreSQL, SQLite, …) so the machine's changing load falls on both alike."""
    servers, urls = [], {}
    try:
        for name, (ws, store) in stores.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            servers.append(services.start(ws, "mlflow", services.mlflow_command(ws, "127.0.0.1", port, store),
                                          urls[name], "/health", ws.home / f"mlflow-{name}.log"))
        services.wait_healthy(servers, timeout_s=180)
        rows = {name: [] for name in stores}
        for n in clients:
            for name, url in urls.items():
                rows[name].append(measure(url, n, seconds))
                print(f"{name:10s} {json.dumps(rows[name][-1])}", flush=True)
        return rows
    finally:
        services.stop(servers)


def start_up(name: str, root: Path, database: str | None) -> dict:
    """``sim2edge up`` (``--database database`` unless None) in its own folder under ``root``, once it answers."""
    from tests.servers import wait_up
    from tests.test_team_runs import SIM2EDGE, TASK, TINY, clean_env

    d = root / f"pipeline-{name}"
    d.mkdir()
    (d / "tiny.yaml").write_text(TINY)
    (d / "team_task.py").write_text(TASK)
    mlflow_port, prefect_port = free_port(), free_port()
    log = d / "up.log"
    t0 = time.perf_counter()
    with log.open("wb") as out:
        up = subprocess.Popen([SIM2EDGE, "up", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                               *(["--database", database] if database else [])],
                              env=clean_env(SIM2EDGE_HOME=str(d / "server")), stdout=out, stderr=subprocess.STDOUT)
    stack = {"name": name, "dir": d, "up": up, "mlflow": f"http://127.0.0.1:{mlflow_port}",
             "prefect": f"http://127.0.0.1:{prefect_port}/api", "runs": []}
    try:
        wait_up(up, log)
    except BaseException:
        stop_up(stack)
        raise
    stack["up_s"] = round(time.perf_counter() - t0, 1)
    return stack


def stop_up(stack: dict) -> None:
    up = stack["up"]
    up.send_signal(signal.SIGINT)
    try:
        up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        up.kill()


def pipeline_run(stack: dict, i: int) -> dict:
    """One ``sim2edge run`` of the tiny configuration from a fresh workspace (a laptop: no stage cache) against
    ``stack``, pointed at it as tests/test_team_runs.py does: wall seconds and its stage seconds from MLflow."""
    from mlflow.tracking import MlflowClient

    from tests.test_team_runs import REPO, SIM2EDGE, clean_env

    d = stack["dir"]
    env = clean_env(SIM2EDGE_HOME=str(d / f"laptop-{i}"), MLFLOW_TRACKING_URI=stack["mlflow"],
                    PREFECT_API_URL=stack["prefect"], OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}:{d}")
    t0 = time.perf_counter()
    done = subprocess.run([SIM2EDGE, "run", "--config", str(d / "tiny.yaml"), "--task", "team_task:TeamCart"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{stack['name']}: sim2edge run exited {done.returncode}:\n{done.stdout[-3000:]}")
    client = MlflowClient(stack["mlflow"])
    experiments = [e.experiment_id for e in client.search_experiments()]
    (parent,) = client.search_runs(experiments, "metrics.`seconds.total` > 0", order_by=["attributes.start_time DESC"],
                                   max_results=1)
    stages = {k.split(".", 1)[1]: round(v, 1) for k, v in parent.data.metrics.items() if k.startswith("seconds.")}
    row = {"backend": stack["name"], "run": i, "wall_s": round(wall, 1), "stage_s": stages}
    print(f"pipeline {json.dumps(row)}", flush=True)
    return row


def pipelines(root: Path, pg_port: int, runs: int) -> list[dict]:
    """Both stacks up at once, then ``runs`` runs on each, alternating (SQLite, PostgreSQL, SQLite, …) so that the
    machine's changing load falls on both alike; per backend: up's start-up, each run's wall and the medians."""
    stacks = []
    try:
        stacks.append(start_up("sqlite", root, None))
        stacks.append(start_up("postgresql", root, f"postgresql://postgres@127.0.0.1:{pg_port}/pipeline"))
        for i in range(runs):
            for stack in stacks:
                stack["runs"].append(pipeline_run(stack, i))
    finally:
        for stack in stacks:
            stop_up(stack)
    out = []
    for stack in stacks:
        walls = [r["wall_s"] for r in stack["runs"]]
        keys = stack["runs"][0]["stage_s"]
        out.append({"backend": stack["name"], "up_s": stack["up_s"], "walls_s": walls,
                    "wall_s": round(statistics.median(walls), 1),
                    "stage_s": {k: round(statistics.median(r["stage_s"].get(k, 0.0) for r in stack["runs"]), 1)
                                for k in keys}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per backend and N")
    parser.add_argument("--pipeline", action="store_true",
                        help="also tiny `sim2edge run`s against `sim2edge up` on each backend")
    parser.add_argument("--pipeline-runs", type=int, default=1, help="runs per backend with --pipeline, alternating")
    args = parser.parse_args()
    started, load = time.perf_counter(), Path("/proc/loadavg").read_text().split()[:3]
    if not (PG_BIN / "initdb").exists():
        raise SystemExit(f"needs Debian's postgresql 15 ({PG_BIN})")
    root = Path(tempfile.mkdtemp(prefix="s2e-team-bench-"))
    root.chmod(0o711)  # the postgres user goes through it to its own folder
    pg = root / "pg"
    pg.mkdir()
    try:
        pg_port = start_postgres(pg)
        db = team_database.parse(f"postgresql://postgres@127.0.0.1:{pg_port}/bench")
        team_database.prepare(db)
        rows = backends({"sqlite": (Workspace(home=root / "sqlite"), None),
                         "postgresql": (Workspace(home=root / "postgresql"), db.mlflow_url)}, args.clients, args.seconds)
        sqlite, postgres = rows["sqlite"], rows["postgresql"]
        pipes = pipelines(root, pg_port, args.pipeline_runs) if args.pipeline else []
    finally:
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(pg / "data"), "-m", "fast", "stop")
        shutil.rmtree(root, ignore_errors=True)
    print()
    for s, p in zip(sqlite, postgres):
        print(f"N={s['clients']}: SQLite {s['requests_per_s']} req/s ({s['runs_per_s']} runs/s), p50 {s['p50_ms']} ms, "
              f"p99 {s['p99_ms']} ms, {s['errors']} errors | PostgreSQL {p['requests_per_s']} req/s "
              f"({p['runs_per_s']} runs/s), p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms, {p['errors']} errors | "
              f"PostgreSQL/SQLite throughput {p['requests_per_s'] / s['requests_per_s']:.2f}x, "
              f"p99 {p['p99_ms'] / s['p99_ms']:.2f}x")
        for row in (s, p):
            if row["errors"]:
                print(f"   errors ({'SQLite' if row is s else 'PostgreSQL'}): {row['first_errors']}")
    if pipes:
        s, p = pipes
        stages = " ".join(f"{k} {s['stage_s'][k]}/{p['stage_s'].get(k, float('nan'))} s "
                          f"({p['stage_s'].get(k, float('nan')) / s['stage_s'][k]:.2f}x)"
                          for k in s["stage_s"] if s["stage_s"][k])
        print(f"pipeline ({len(s['walls_s'])} runs each, medians): sim2edge run wall SQLite {s['wall_s']} s "
              f"{s['walls_s']} | PostgreSQL {p['wall_s']} s {p['walls_s']} | PostgreSQL/SQLite "
              f"{p['wall_s'] / s['wall_s']:.2f}x; up start {s['up_s']}/{p['up_s']} s; stages SQLite/PostgreSQL: "
              f"{stages}")
    print(f"load average at start {' '.join(load)}, at end {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; "
          f"{(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
