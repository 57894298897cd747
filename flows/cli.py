"""``sim2edge``: run the pipeline, start the servers, list tasks and targets."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flows.workspace import Workspace

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


@app.command()
def run(
    task: Optional[str] = typer.Option(None, help="Registered task or module:Class [default: the config's, or cartpole]."),
    target: Optional[str] = typer.Option(None, help="Jetson target profile [default: orin-jp6.1]."),
    iterations: Optional[int] = typer.Option(None, help="PPO iterations [default: the task's preset]."),
    seed: Optional[int] = typer.Option(None, help="Seed for every stage [default: 0]."),
    eval_episodes: Optional[int] = typer.Option(None, help="Seeded evaluation episodes [default: 32]."),
    minutes: Optional[float] = typer.Option(None, help="Training budget in minutes (iterations stays the cap)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A run configuration (YAML): the flow's parameters, "
                                                                 "over the task's preset."),
    sets: list[str] = typer.Option([], "--set", help="Override one key, e.g. --set train.learning_rate=3e-4 "
                                                     "(repeatable)."),
) -> None:
    """Run collect → calibrate → train → export → evaluate → package → register as one Prefect flow.

    Parameters come from the task's preset (`sim2edge tasks --show TASK`), then --config, then --set, then the
    options above."""
    from flows.run_config import RunConfigError, resolve

    try:
        params = resolve(task, config, sets, {"target": target, "iterations": iterations, "seed": seed,
                                              "eval_episodes": eval_episodes,
                                              "train": {"minutes": minutes} if minutes is not None else None})
    except RunConfigError as e:
        _fail(str(e))
    ws = Workspace.from_env()
    ws.home.mkdir(parents=True, exist_ok=True)
    ws.configure_prefect()
    from flows.gate import verdict
    from flows.sim_to_edge import sim_to_edge

    start = time.perf_counter()
    s = sim_to_edge(params)
    table = Table(title=f"sim-to-edge {s.policy} ({time.perf_counter() - start:.0f} s)", show_header=False)
    # 20 columns: the key column and the borders
    for k, v in [("model version", s.version), ("alias", s.alias), ("success rate", f"{s.success_rate:.2f}"),
                 ("mean return", f"{s.mean_return:.1f}"), ("gate", verdict(s.gate_checks, max(40, console.width - 20))),
                 ("bundle sha256", s.bundle_sha256), ("MLflow run", f"{s.mlflow_run_id} ({s.tracking_uri})")]:
        table.add_row(k, v)
    console.print(table)
    console.print(f"Every gate clause: sim2edge gate show {s.mlflow_run_id}", markup=False, highlight=False)
    console.print("Pull it onto a device (with `sim2edge up` running):")
    console.print(s.pull_command, soft_wrap=True, markup=False, highlight=False)


def _standalone(ws: Workspace, task: str):
    """The MLflow context a single-stage command logs to: the task's experiment, no parent run."""
    from registry.tracking import standalone
    from stages.sim.registry import load

    return standalone(ws.tracking_uri(), f"sim2edge/{load(task).name}", ws.artifact_root())


def _check_task(task: str) -> None:
    from stages.sim.registry import load

    try:
        load(task)
    except (KeyError, ImportError, AttributeError, ValueError) as e:
        _fail(f"--task: {str(e).strip(chr(34))}")


@app.command()
def collect(
    task: str = typer.Option("cartpole", help="Registered task or module:Class."),
    source: str = typer.Option("standin", help="standin (record the reference-robot stand-in), folder, registry or rosbag."),
    folder: Optional[Path] = typer.Option(None, help="Log folder to ingest (with --source folder)."),
    bag: Optional[Path] = typer.Option(None, help="rosbag2 directory or .mcap/.db3 file (with --source rosbag)."),
    mapping: Optional[Path] = typer.Option(None, help="Topic mapping YAML of the bag (with --source rosbag)."),
    episodes: int = typer.Option(16, help="Stand-in episodes to record."),
    seed: int = typer.Option(0, help="Stand-in seed."),
) -> None:
    """Ingest new robot logs into the task's versioned dataset store; bad files are quarantined."""
    from flows.steps import collect_step
    from stages.collect.ingest import StandinConfig

    if source not in ("standin", "folder", "registry", "rosbag"):
        console.print(f"[red]error[/red]: --source {source!r}: choose standin, folder, registry or rosbag")
        raise typer.Exit(2)
    if source == "rosbag" and (bag is None or mapping is None):
        _fail("--source rosbag needs --bag DIR|FILE and --mapping robot.yaml")
    _check_task(task)
    ws = Workspace.from_env()
    try:
        if source == "rosbag":
            from flows.steps import dataset_store
            from stages.collect.bag_mapping import load_mapping
            from stages.collect.ingest import ingest_bag

            report = ingest_bag(dataset_store(ws, task), bag, load_mapping(mapping))
            if report.dataset is None:
                raise ValueError(f"no dataset for task {task!r}: "
                                 f"{'; '.join(q.reason for q in report.quarantined) or 'no episodes in the bag'}")
        else:
            report = collect_step(_standalone(ws, task), ws, task, source, StandinConfig(episodes=episodes, seed=seed), folder)
    except (ValueError, FileNotFoundError) as e:
        console.print(Text.assemble(("error", "red"), f": {e}"), soft_wrap=True)
        raise typer.Exit(1)
    for q in report.quarantined:
        console.print(Text.assemble(("quarantined ", "yellow"), q.reason), soft_wrap=True)
    ds = report.dataset
    console.print(f"{len(report.added)} new, {len(report.duplicates)} already ingested, {len(report.quarantined)} quarantined")
    console.print(f"dataset {ds.task} v{ds.version:04d} ({'new' if report.new_version else 'unchanged'}): "
                  f"{ds.episodes} episodes, {ds.rows} rows, digest {ds.digest[:16]}  {ds.path}", soft_wrap=True)


@app.command()
def calibrate(
    task: str = typer.Option("cartpole", help="Registered task or module:Class."),
    dataset: str = typer.Option("latest", help="Dataset version (v0003) or latest."),
    generations: int = typer.Option(40, help="CMA-ES generations for the chosen latency."),
    max_latency: int = typer.Option(3, help="Largest actuation latency searched (control steps)."),
    seed: int = typer.Option(0),
) -> None:
    """Fit the digital twin to a dataset version; print fitted vs prior (vs stand-in truth) and sensitivity."""
    from flows.steps import calibrate_step, dataset_store
    from stages.twin.calibrate import FITTED, CalibrateConfig

    _check_task(task)
    ws = Workspace.from_env()
    store = dataset_store(ws, task)
    try:
        ds = store.latest() if dataset == "latest" else store.version(dataset)
    except KeyError as e:
        _fail(f"--dataset: {str(e).strip(chr(34))}")
    if ds is None:
        _fail(f"no dataset for {task!r} in {store.root}; run `sim2edge collect` first")
    cfg = CalibrateConfig(generations=generations, max_latency=max_latency, seed=seed)
    twin = calibrate_step(_standalone(ws, task), cfg, ds, ws.home / "twins" / store.task.name / f"v{ds.version:04d}")
    spec = json.loads(twin.path.read_text())
    truth = spec.get("standin_truth")
    table = Table("parameter", "prior", "fitted", "± (rel. 1σ)", "sensitivity", *(["stand-in truth"] if truth else []),
                  title=f"twin of {task} on dataset v{ds.version:04d}")
    for name in (*FITTED, "latency_steps", "obs_noise"):
        fitted = "prior (unidentifiable)" if name in twin.unidentified else f"{spec['params'][name]:.4g}"
        sens = spec["sensitivity"].get(name)
        table.add_row(name, f"{spec['prior'][name]:.4g}", fitted,
                      f"{spec['uncertainty'][name]:.2%}" if name in spec["uncertainty"] else "",
                      f"{sens:.3g}" if sens is not None else "", *([f"{truth[name]:.4g}"] if truth else []))
    console.print(table)
    console.print(f"replay error {twin.replay_error_before:.4g} → {twin.replay_error_after:.4g} "
                  f"({twin.replay_error_before / twin.replay_error_after:.1f}× lower); twin {twin.path}", soft_wrap=True)


@app.command()
def evaluate(
    policy: Optional[str] = typer.Argument(None, help="A registered version: NAME@ALIAS or NAME@VERSION."),
    bundle: Optional[Path] = typer.Option(None, help="A bundle file instead (its signature is checked)."),
    trust: Optional[Path] = typer.Option(None, help="Public key for --bundle (default: the workspace's)."),
    twin: Optional[Path] = typer.Option(None, help="twin.json (default: the version's own twin; nominal for a bundle)."),
    suite: Optional[Path] = typer.Option(None, help="Scenario suite file (default: the task's)."),
    episodes: Optional[int] = typer.Option(None, help="Episodes per scenario (default: the suite's)."),
    seed: int = typer.Option(1000),
    video: bool = typer.Option(True, help="Render the nominal and worst episodes into the report."),
) -> None:
    """Run the scenario suite on a registered version or a bundle; log the report to MLflow and print the gate."""
    import tempfile

    from edge import bundle as bundle_format, signing
    from edge.errors import CheckFailed
    from registry import lineage
    from registry.tracking import stage_run
    from stages.artifacts import ExportedPolicy
    from stages.twin.calibrate import twin_from_file
    from stages.twin.evaluate import EvalConfig, evaluate as run_suite
    from stages.twin.gate import GateConfig

    ws = Workspace.from_env()
    work = Path(tempfile.mkdtemp(prefix="evaluate-", dir=ws.home))
    if (policy is None) == (bundle is None):
        _fail("give NAME@ALIAS|NAME@VERSION or --bundle FILE (one of them)")
    if bundle is not None:
        try:
            manifest = bundle_format.extract(bundle, work / "bundle", 1 << 30,
                                             trusted=signing.load_trusted([trust or ws.keys_dir / "signing.pub"]))
        except (CheckFailed, OSError, ValueError) as e:  # the agent's own refusal names the check
            _fail(f"--bundle {bundle}: {e}")
        onnx, task, label = work / "bundle" / "policy.onnx", manifest["policy"]["task"], f"bundle {bundle.name}"
    else:
        from mlflow.tracking import MlflowClient

        name, _, ref = policy.partition("@")
        client = MlflowClient(ws.tracking_uri())
        try:
            version = client.get_model_version(name, ref) if ref.isdigit() else client.get_model_version_by_alias(name, ref)
        except Exception as e:
            _fail(f"{policy}: no such registered version ({e})")
        onnx = lineage.stage_artifact(client, version, "export", "onnx/policy.onnx", work / "onnx")
        twin = twin or lineage.stage_artifact(client, version, "calibrate", "twin/twin.json", work / "twin")
        task, label = version_task(version), f"{name} v{version.version}"
    spec = twin_from_file(twin, task)
    exported = ExportedPolicy(path=onnx, digest=bundle_format.sha256_path(onnx), task=task, opset=0,
                              parity_max_abs_error=0.0, golden=onnx)
    cfg = EvalConfig(episodes=episodes, seed=seed, suite=suite, video=video)
    try:
        cfg.load_suite(task)
    except ValueError as e:
        _fail(str(e))
    with stage_run(_standalone(ws, task), "evaluate", {**cfg.model_dump(), "policy": label}) as run:
        report = run_suite(cfg, GateConfig(), exported, spec, ws.home / "evaluations" / run.run_id)
        run.artifact(report.path.parent, "evaluation")
        run.tags({"sim2edge.gate": "pass" if report.passed else "fail", "sim2edge.evaluated": label})
    table = Table("scenario", "success", "≥ (95%)", "mean return", title=f"{label} in the {'twin' if twin else 'nominal model'}")
    for r in report.scenarios:
        table.add_row(r.name, f"{r.success_rate:.2f}", f"{r.success_low:.2f}", f"{r.mean_return:.1f}")
    console.print(table)
    for reason in report.reasons:
        console.print(reason, markup=False, highlight=False)
    console.print(f"{'PASSED' if report.passed else 'FAILED'}; report {report.html}", soft_wrap=True, markup=False)
    if not report.passed:
        raise typer.Exit(1)


def version_task(version) -> str:
    """The task a registered version was trained on: its recorded name if this install knows it, else its
    ``module:Class`` (a user's own task needs no entry point); warns when the task's source changed since."""
    from stages.sim import registry

    tags = version.tags
    task = tags.get("sim2edge.task", version.name)
    if task not in registry.names() and ":" not in task:
        task = tags.get("sim2edge.task_ref", task)
    try:
        ref, digest = registry.reference(task)
    except (KeyError, ImportError, AttributeError) as e:
        _fail(f"{version.name} v{version.version} was trained on task {task!r}, which cannot be loaded here ({e})")
    if tags.get("sim2edge.task_sha256") not in (None, digest):
        console.print(f"warning: the source of {ref} changed since {version.name} v{version.version} was registered",
                      markup=False, highlight=False)
    return task


@app.command()
def devices(model: Optional[str] = typer.Option(None, help="Registered model (default: every one)."),
            as_json: bool = typer.Option(False, "--json", help="Print the reports as JSON.")) -> None:
    """List the devices reporting to the registry (sim2edge-agent watch and run): version, health, runtime,
    control-loop timing, last error."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from registry.devices import devices as reports

    try:
        states = reports(MlflowClient(Workspace.from_env().tracking_uri()), model)
    except (MlflowException, ValueError) as e:
        _fail(str(e))
    if as_json:
        _print_json([d.model_dump() for d in states])
        return
    if not states:
        console.print("no device has reported")
        return
    rows = []
    for d in states:
        e, c = d.last_error or {}, d.control
        loop = (f"act p99 {c.get('act_p99_us')} us, {c.get('deadline_misses', 0)} late, "
                f"{c.get('safe_default', 0)} unsafe, {c.get('watchdog_trips', 0)} watchdog / {c.get('ticks', 0)} ticks"
                if c else "-")
        rows.append([d.model, d.device, d.version or "-", d.health or "-", d.runtime or "-", loop, f"{d.age_s:.0f} s ago",
                     f"{e.get('check') or e.get('event')}: {e.get('detail', '')}"[:100] if e else ""])
    print_listing(listing(["model", "device", "version", "health", "runtime", "control loop", "reported", "last error"],
                          rows, ids=2))


def listing(headers: list[str], rows: list[list[str]], ids: int = 1) -> Table:
    """A table whose first ``ids`` columns are identifiers: never wrapped nor cut; the other columns fold."""
    table = Table()
    for i, header in enumerate(headers):
        if i < ids:
            table.add_column(header, no_wrap=True, min_width=max(len(header), *(len(r[i]) for r in rows)))
        else:
            table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_listing(table: Table, out: Console = console) -> None:
    """A terminal gets the table fitted to its width; a pipe or file gets it whole, as wide as it is."""
    if not out.is_terminal:
        out = Console(width=out.measure(table, options=out.options.update_width(1 << 20)).maximum, file=out.file)
    out.print(table)


def _print_json(value: object) -> None:
    """Plain JSON on stdout (no wrapping, no colour), for scripts."""
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def _fail(message: str, code: int = 2) -> None:
    console.print(Text.assemble(("error", "red"), f": {message}"), soft_wrap=True)
    raise typer.Exit(code)


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
    try:
        running = services.up(ws, host, prefect_port, mlflow_port)
    except services.PortInUse as e:
        _fail(str(e))
    except services.ServiceError as e:
        _fail(str(e), code=1)
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
def serve(
    timezone: str = typer.Option("UTC", help="Timezone of the nightly schedule (IANA name)."),
    cron: str = typer.Option("0 2 * * *", help="Nightly schedule."),
) -> None:
    """Serve the sim-to-edge and nightly-retrain deployments from this process (one machine) on the Prefect
    server of `sim2edge up` (or PREFECT_API_URL); Ctrl-C stops."""
    ws = Workspace.from_env()
    ws.home.mkdir(parents=True, exist_ok=True)
    ws.configure_prefect()
    from flows.services import PrefectUnavailable, prefect_api

    try:
        prefect_api()  # before the flows' imports: a missing server is reported at once
        from flows.deployments import serve as serve_deployments

        serve_deployments(timezone, cron)
    except PrefectUnavailable as e:
        _fail(str(e), code=1)


@app.command()
def deploy(
    pool: str = typer.Option("sim2edge-process", help="Process work pool (created if missing)."),
    timezone: str = typer.Option("UTC", help="Timezone of the nightly schedule (IANA name)."),
) -> None:
    """Register both deployments of prefect.yaml on a work pool of the Prefect server (PREFECT_API_URL)."""
    ws = Workspace.from_env()
    ws.configure_prefect()
    from flows.deployments import deploy as deploy_all

    done = deploy_all(pool, timezone)
    console.print(done.stdout[-3000:], markup=False, highlight=False)
    if done.returncode != 0:
        console.print(done.stderr[-3000:], markup=False, highlight=False)
        raise typer.Exit(done.returncode)
    console.print(f"Start a worker: prefect worker start --pool {pool}", markup=False)


@app.command()
def tasks(as_json: bool = typer.Option(False, "--json", help="Print the tasks as JSON."),
          show: Optional[str] = typer.Option(None, "--show", metavar="TASK",
                                             help="One task in full: its terms, commands, sensors and preset.")) -> None:
    """List the registered tasks."""
    from stages.sim.registry import load, names

    if show is not None:
        _check_task(show)
        _show_task(show, load(show))
        return
    found = {name: load(name) for name in names()}
    if as_json:
        _print_json({name: {"mjcf": str(t.mjcf), "observations": [o.name for o in t.observations],
                            "actions": [a.name for a in t.actions], "control_period_s": t.ctrl_dt,
                            "episode_steps": t.episode_steps} for name, t in found.items()})
        return
    rows = [[name, str(t.obs_dim), str(t.act_dim), f"{t.ctrl_dt * 1e3:.0f} ms", t.mjcf.name] for name, t in found.items()]
    print_listing(listing(["task", "observations", "actions", "control period", "robot"], rows))


def _show_task(ref: str, t) -> None:
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


@app.command()
def targets(as_json: bool = typer.Option(False, "--json", help="Print the profiles as JSON.")) -> None:
    """List the Jetson target profiles."""
    from edge.targets import PROFILES

    if as_json:
        _print_json({n: p.to_dict() for n, p in PROFILES.items()})
        return
    rows = []
    for p in PROFILES.values():
        d = p.to_dict()
        rows.append([p.name, p.module, p.jetpack, f"{d['l4t_min']} – <{d['l4t_max']}", p.tensorrt, str(p.max_opset),
                     p.python])
    print_listing(listing(["target", "module", "JetPack", "L4T", "TensorRT", "max opset", "Python"], rows))


gate_app = typer.Typer(no_args_is_help=True, help="The evaluation gate of a run or registered version.")
app.add_typer(gate_app, name="gate")


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
        _fail(str(e))
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


keys_app = typer.Typer(no_args_is_help=True, help="Ed25519 signing keys: generate a pair, print the public key.")
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(out: Path = typer.Option(..., help="Folder for signing.key (0600) and signing.pub.")) -> None:
    """Write a new signing pair; refuses to overwrite an existing key."""
    from edge import signing

    if (out / "signing.key").exists():
        _fail(f"{out / 'signing.key'} exists; move it away first (keys are never overwritten)")
    signing.generate_keypair(out / "signing.key", out / "signing.pub")
    console.print(f"wrote {out / 'signing.key'} (private, 0600) and {out / 'signing.pub'} (give this to devices: "
                  f"sim2edge-agent pull … --trust signing.pub)", soft_wrap=True, markup=False, highlight=False)


@keys_app.command("public")
def keys_public(key: Optional[Path] = typer.Option(None, help="Private key file (default: $SIM2EDGE_SIGNING_KEY, "
                                                             "else the workspace's).")) -> None:
    """Print the public key (PEM) that devices pin with --trust."""
    from edge import signing

    try:
        private = signing.load_private(key) if key else signing.signing_key(Workspace.from_env().keys_dir / "signing.key")
    except (OSError, ValueError) as e:
        _fail(str(e))
    sys.stdout.write(signing.public_pem(private).decode())


@app.command("package")
def package_image(
    bundle: Path = typer.Argument(..., help="A signed bundle (from `sim2edge run` or `sim2edge import`)."),
    trust: Optional[Path] = typer.Option(None, help="Public key to verify it (default: the workspace's)."),
    context: Optional[Path] = typer.Option(None, help="Where to write the build context (default: BUNDLE-image/)."),
    image: bool = typer.Option(False, "--image", help="Build the Jetson image with the Docker daemon."),
    base: Optional[str] = typer.Option(None, help="Base image (default: the target's l4t-jetpack tag)."),
    registry: Optional[str] = typer.Option(None, help="Push to this registry (host:port) after building."),
) -> None:
    """Write the Jetson image's build context for a bundle; --image builds it (and --registry pushes)."""
    from stages.image import ImageConfig, build_and_push, docker_client, jetson_context

    trust = trust or Workspace.from_env().keys_dir / "signing.pub"
    out = context or bundle.with_name(bundle.stem + "-image")
    try:
        ctx = jetson_context(ImageConfig(base=base, registry=registry), bundle, trust, out)
    except Exception as e:  # the agent's refusal names the failed check
        _fail(f"{bundle}: {e}")
    console.print(f"build context for {ctx.target}: {ctx.path}", soft_wrap=True, markup=False, highlight=False)
    client = docker_client() if image else None
    if client is None:
        if image:
            console.print("no Docker daemon reachable (DOCKER_HOST); build it with:", markup=False)
        console.print(ctx.command, soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(1 if image else 0)
    try:
        built = build_and_push(client, ctx.path, ctx.tag, ctx.build_args, ctx.platform, push=registry is not None)
    except RuntimeError as e:
        _fail(str(e))
    console.print(f"built {built.tag} ({built.image_id})" + (f", pushed {built.pushed}" if built.pushed else ""),
                  soft_wrap=True, markup=False, highlight=False)


@app.command("import")
def import_policy(
    source: Path = typer.Argument(..., help="rsl_rl checkpoint (model_*.pt) or policy.onnx (Isaac Lab export)."),
    spec: Path = typer.Option(..., help="I/O spec (YAML or JSON): observations, actions, control period."),
    target: str = typer.Option("orin-jp6.1", help="Jetson target profile."),
    name: str = typer.Option("imported", help="Policy name in the manifest."),
    version: str = typer.Option("1", help="Policy version in the manifest."),
    out: Path = typer.Option(Path("imported"), help="Folder for onnx/ and bundle.tar."),
) -> None:
    """Import an external policy: parity-checked ONNX, op check for the target, signed bundle."""
    from edge.bundle import sha256_path
    from stages.export import ExportConfig, ParityError
    from stages.import_policy import import_checkpoint, import_onnx
    from stages.io_spec import IOSpec
    from stages.package import PackageConfig, build_manifest, package

    ws = Workspace.from_env()
    try:
        io_spec, cfg = IOSpec.from_file(spec), PackageConfig(target=target)
        reader = import_onnx if source.suffix == ".onnx" else import_checkpoint
        exported = reader(ExportConfig(), source, spec, out / "onnx")
        provenance = {"imported_from": source.name, "source_sha256": sha256_path(source), "spec_sha256": sha256_path(spec)}
        manifest = build_manifest(cfg, name, version, exported, io_spec, provenance, None)
        art = package(cfg, manifest, exported, ws.keys_dir, out / "bundle.tar")
    except (OSError, KeyError, ValueError, ParityError) as e:
        _fail(str(e).strip('"'))
    console.print(f"parity max error {exported.parity_max_abs_error:.2g}; bundle {art.path} sha256 {art.digest}",
                  soft_wrap=True, markup=False, highlight=False)
    if io_spec.task != "external":
        console.print(f"evaluate it in the twin: sim2edge evaluate --bundle {art.path}", soft_wrap=True, markup=False)


def main() -> None:
    # like `python -m`, make the working directory importable, for `--task mypkg.mymodule:MyTask`
    sys.path.insert(0, os.getcwd())
    app()
