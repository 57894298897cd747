"""``sim2edge tasks``, ``targets`` and ``gate show``: what can be run, where, and how a run was judged."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from flows.cli_output import check_task, console, fail, listing, print_json, print_listing
from flows.workspace import Workspace


def tasks(as_json: bool = typer.Option(False, "--json", help="Print the tasks as JSON."),
          show: Optional[str] = typer.Option(None, "--show", metavar="TASK",
                                             help="One task in full: its terms, commands, sensors and preset.")) -> None:
    """List the registered tasks."""
    from stages.sim.registry import load, names

    if show is not None:
        check_task(show)
        show_task(show, load(show))
        return
    found = {name: load(name) for name in names()}
    if as_json:
        print_json({name: {"mjcf": str(t.mjcf), "observations": [o.name for o in t.observations],
                            "actions": [a.name for a in t.actions], "control_period_s": t.ctrl_dt,
                            "episode_steps": t.episode_steps} for name, t in found.items()})
        return
    rows = [[name, str(t.obs_dim), str(t.act_dim), f"{t.ctrl_dt * 1e3:.0f} ms", t.mjcf.name] for name, t in found.items()]
    print_listing(listing(["task", "observations", "actions", "control period", "robot"], rows))


def show_task(ref: str, t) -> None:
    """A task's I/O (each term's source, unit, noise and delay), commands, sensors and its resolved run preset."""
    import yaml

    from flows.run_config import resolve

    console.print(f"{t.name}: {t.mjcf}, control period {t.ctrl_dt * 1e3:.0f} ms, {t.episode_steps} steps per episode",
                  markup=False, highlight=False)
    rows = [[o.name, o.source, o.unit, f"{o.noise:g}" if o.noise else "", str(o.delay_steps or "")]
            for o in t.observations]
    rows += [[p.name, "privileged (critic only)", p.unit, "", ""] for p in t.privileged]
    rows += [[a.name, "action", a.unit, "", ""] for a in t.actions]
    print_listing(listing(["term", "source", "unit", "noise", "delay"], rows))
    if t.commands:
        print_listing(listing(["command", "unit", "low", "high", "resampled every"],
                              [[c.name, c.unit, f"{c.low:g}", f"{c.high:g}",
                                f"{c.resample_steps} steps" if c.resample_steps else "episode"] for c in t.commands]))
    if t.sensors:
        console.print(f"sensors: {', '.join(t.sensors)}", markup=False, highlight=False)
    params = resolve(ref, None, [], {})
    console.print(f"run preset ({t.preset_path or 'none: the defaults'}), as `sim2edge run --config` takes it:",
                  markup=False, highlight=False)
    console.print(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False), markup=False, highlight=False)


def targets(as_json: bool = typer.Option(False, "--json", help="Print the profiles as JSON.")) -> None:
    """List the Jetson target profiles."""
    from edge.targets import PROFILES

    if as_json:
        print_json({n: p.to_dict() for n, p in PROFILES.items()})
        return
    rows = []
    for p in PROFILES.values():
        d = p.to_dict()
        rows.append([p.name, p.module, p.jetpack, f"{d['l4t_min']} – <{d['l4t_max']}", p.tensorrt, str(p.max_opset),
                     p.python])
    print_listing(listing(["target", "module", "JetPack", "L4T", "TensorRT", "max opset", "Python"], rows))



gate_app = typer.Typer(no_args_is_help=True, help="The evaluation gate of a run or registered version.")


@gate_app.command("show")
def gate_show(ref: str = typer.Argument(..., help="A pipeline or evaluate run id, or NAME@ALIAS / NAME@VERSION.")) -> None:
    """Every gate clause: verdict, scenario, check, value and the threshold it is held to; exits 1 when the gate
    failed."""
    from mlflow.tracking import MlflowClient

    from flows.gate import Clause, load_checks, resolve_run

    client = MlflowClient(Workspace.from_env().tracking_uri())
    try:
        run_id = resolve_run(client, ref)
        checks = load_checks(client, run_id)
    except ValueError as e:
        fail(str(e))
    clauses = [Clause.of(c) for c in checks]
    failed = sum(not c.passed for c in clauses)
    table = Table("verdict", "scenario", "check", "value", "threshold",
                  title=f"gate of run {run_id}: {'FAIL' if failed else 'pass'} ({len(clauses) - failed}/{len(clauses)} pass)")
    for c in clauses:
        table.add_row(Text("pass", "green") if c.passed else Text("FAIL", "bold red"), c.scenario or "suite", c.check,
                      c.value, c.threshold)
    print_listing(table)
    if failed:
        raise typer.Exit(1)
