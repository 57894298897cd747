"""``sim2edge``: run the pipeline, start the servers, list tasks and targets."""

from __future__ import annotations

import json
import os
import sys
import time

import typer
from rich.console import Console
from rich.table import Table

from flows.workspace import Workspace

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


@app.command()
def run(
    task: str = typer.Option("cartpole", help="Registered task or module:Class."),
    target: str = typer.Option("orin-jp6.1", help="Jetson target profile."),
    iterations: int = typer.Option(100, help="PPO iterations."),
    seed: int = typer.Option(0, help="Seed for every stage."),
    eval_episodes: int = typer.Option(32, help="Seeded evaluation episodes."),
) -> None:
    """Run collect → calibrate → train → export → evaluate → package → register as one Prefect flow."""
    from pydantic import ValidationError

    ws = Workspace.from_env()
    ws.home.mkdir(parents=True, exist_ok=True)
    ws.configure_prefect()
    from flows.params import SimToEdgeParams

    try:
        params = SimToEdgeParams(task=task, target=target, iterations=iterations, seed=seed, eval_episodes=eval_episodes)
    except ValidationError as e:
        for err in e.errors():
            console.print(f"[red]error[/red]: {'.'.join(map(str, err['loc']))}: {err['msg']}")
        raise typer.Exit(2)
    from flows.sim_to_edge import sim_to_edge

    start = time.perf_counter()
    s = sim_to_edge(params)
    table = Table(title=f"sim-to-edge {s.policy} ({time.perf_counter() - start:.0f} s)", show_header=False)
    for k, v in [("model version", s.version), ("alias", s.alias), ("success rate", f"{s.success_rate:.2f}"),
                 ("mean return", f"{s.mean_return:.1f}"), ("gate", "; ".join(s.gate_reasons)),
                 ("bundle sha256", s.bundle_sha256), ("MLflow run", f"{s.mlflow_run_id} ({s.tracking_uri})")]:
        table.add_row(k, v)
    console.print(table)
    console.print("Pull it onto a device (with `sim2edge up` running):")
    console.print(s.pull_command, soft_wrap=True, markup=False, highlight=False)


@app.command()
def up(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    prefect_port: int = typer.Option(4200),
    mlflow_port: int = typer.Option(5000),
) -> None:
    """Start a Prefect server and an MLflow tracking server for this workspace; Ctrl-C stops both."""
    import signal

    from flows import services

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    ws = Workspace.from_env()
    running = services.up(ws, host, prefect_port, mlflow_port)
    console.print(f"Prefect UI  http://{host}:{prefect_port}\nMLflow UI   http://{host}:{mlflow_port}\n"
                  f"workspace   {ws.home}\nCtrl-C stops both.")
    try:
        while all(s.process.poll() is None for s in running):
            time.sleep(1)
        console.print("[red]a server exited[/red]; stopping")
    except KeyboardInterrupt:
        console.print("stopping")
    finally:
        services.stop(running)
        ws.services_file.unlink(missing_ok=True)


@app.command()
def tasks() -> None:
    """List the registered tasks."""
    from stages.sim.registry import load, names

    for name in names():
        t = load(name)
        console.print(f"{name}: obs {t.obs_dim}, actions {t.act_dim}, control period {t.ctrl_dt * 1e3:.0f} ms")


@app.command()
def targets(as_json: bool = typer.Option(False, "--json")) -> None:
    """List the Jetson target profiles."""
    from edge.targets import PROFILES

    if as_json:
        console.print_json(json.dumps({n: p.to_dict() for n, p in PROFILES.items()}))
        return
    table = Table("target", "module", "JetPack", "L4T", "TensorRT", "max opset", "Python")
    for p in PROFILES.values():
        d = p.to_dict()
        table.add_row(p.name, p.module, p.jetpack, f"{d['l4t_min']} – <{d['l4t_max']}", p.tensorrt, str(p.max_opset), p.python)
    console.print(table)


def main() -> None:
    # like `python -m`, make the working directory importable, for `--task mypkg.mymodule:MyTask`
    sys.path.insert(0, os.getcwd())
    app()
