"""``sim2edge run``, ``collect``, ``calibrate`` and ``evaluate``: the chain and its stages one at a time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from flows.cli_output import check_task, console, fail
from flows.workspace import Workspace


def run(
    task: Optional[str] = typer.Option(None, help="Registered task or module:Class [default: the config's, or cartpole]."),
    target: Optional[str] = typer.Option(None, help="Jetson target profile [default: orin-jp6.1]."),
    iterations: Optional[int] = typer.Option(None, help="PPO iterations [default: the task's preset]."),
    seed: Optional[int] = typer.Option(None, help="Seed for every stage [default: 0]."),
    eval_episodes: Optional[int] = typer.Option(None, help="Seeded evaluation episodes [default: 32]."),
    minutes: Optional[float] = typer.Option(None, help="Training budget in minutes (iterations stays the cap)."),
    dataset_version: Optional[int] = typer.Option(None, help="Start from this version of the task's dataset, collected "
                                                  "beforehand (`sim2edge collect`, e.g. --source rosbag), instead of "
                                                  "recording stand-in logs."),
    config: Optional[Path] = typer.Option(None, "--config", help="A run configuration (YAML): the flow's parameters, "
                                                                 "over the task's preset."),
    sets: list[str] = typer.Option([], "--set", help="Override one key, e.g. --set train.learning_rate=3e-4 "
                                                     "(repeatable)."),
) -> None:
    """Run collect → calibrate → train → export → evaluate → package → register as one Prefect flow (with
    --dataset-version: from a dataset collected beforehand, no collect).

    Parameters come from the task's preset (`sim2edge tasks --show TASK`), then --config, then --set, then the
    options above."""
    from flows.run_config import RunConfigError, resolve

    try:
        params = resolve(task, config, sets, {"target": target, "iterations": iterations, "seed": seed,
                                              "eval_episodes": eval_episodes, "dataset_version": dataset_version,
                                              "train": {"minutes": minutes} if minutes is not None else None})
    except RunConfigError as e:
        fail(str(e))
    ws = Workspace.from_env()
    if params.dataset_version is not None:  # before any run starts: a missing version is the command's error
        from flows.steps import existing_dataset

        try:
            existing_dataset(ws, params.task, params.dataset_version)
        except KeyError as e:
            fail(f"--dataset-version: {str(e).strip(chr(34))}")
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



def standalone_run(ws: Workspace, task: str):
    """The MLflow context a single-stage command logs to: the task's experiment, no parent run."""
    from registry.tracking import standalone
    from stages.sim.registry import load

    return standalone(ws.tracking_uri(), f"sim2edge/{load(task).name}", ws.artifact_root())



def collect(
    task: str = typer.Option("cartpole", help="Registered task or module:Class."),
    source: str = typer.Option("standin", help="standin (record the reference-robot stand-in), folder, registry, rosbag "
                                               "or lerobot."),
    folder: Optional[Path] = typer.Option(None, help="Log folder to ingest (with --source folder)."),
    bag: Optional[Path] = typer.Option(None, help="rosbag2 directory or .mcap/.db3 file (with --source rosbag)."),
    dataset: Optional[Path] = typer.Option(None, help="LeRobot v3 dataset folder (with --source lerobot)."),
    mapping: Optional[Path] = typer.Option(None, help="Topic mapping YAML of the bag (with --source rosbag), or feature "
                                                      "mapping YAML (with --source lerobot; default: what "
                                                      "`sim2edge dataset export` writes)."),
    episodes: int = typer.Option(16, help="Stand-in episodes to record."),
    seed: int = typer.Option(0, help="Stand-in seed."),
) -> None:
    """Ingest new robot logs into the task's versioned dataset store; bad files are quarantined."""
    from flows.steps import collect_step
    from stages.collect.ingest import StandinConfig

    if source not in ("standin", "folder", "registry", "rosbag", "lerobot"):
        console.print(f"[red]error[/red]: --source {source!r}: choose standin, folder, registry, rosbag or lerobot")
        raise typer.Exit(2)
    if source == "rosbag" and (bag is None or mapping is None):
        fail("--source rosbag needs --bag DIR|FILE and --mapping robot.yaml")
    if source == "lerobot" and dataset is None:
        fail("--source lerobot needs --dataset DIR (a LeRobot v3 dataset folder)")
    check_task(task)
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
        elif source == "lerobot":
            from flows.steps import dataset_store
            from stages.collect import lerobot_logs
            from stages.collect.ingest import ingest_lerobot

            report = ingest_lerobot(dataset_store(ws, task), dataset, lerobot_logs.load_mapping(mapping))
            if report.dataset is None:
                raise ValueError(f"no dataset for task {task!r}: "
                                 f"{'; '.join(q.reason for q in report.quarantined) or 'no episodes in the dataset'}")
        else:
            report = collect_step(standalone_run(ws, task), ws, task, source, StandinConfig(episodes=episodes, seed=seed), folder)
    except (ValueError, FileNotFoundError) as e:
        console.print(Text.assemble(("error", "red"), f": {e}"), soft_wrap=True)
        raise typer.Exit(1)
    for q in report.quarantined:
        console.print(Text.assemble(("quarantined ", "yellow"), q.reason), soft_wrap=True)
    ds = report.dataset
    console.print(f"{len(report.added)} new, {len(report.duplicates)} already ingested, {len(report.quarantined)} quarantined")
    console.print(f"dataset {ds.task} v{ds.version:04d} ({'new' if report.new_version else 'unchanged'}): "
                  f"{ds.episodes} episodes, {ds.rows} rows, digest {ds.digest[:16]}  {ds.path}", soft_wrap=True)


def calibrate(
    task: str = typer.Option("cartpole", help="Registered task or module:Class."),
    dataset: str = typer.Option("latest", help="Dataset version (v0003) or latest."),
    generations: int = typer.Option(40, help="CMA-ES generations for the chosen latency."),
    max_latency: int = typer.Option(3, help="Largest actuation latency searched (control steps)."),
    seed: int = typer.Option(0),
) -> None:
    """Fit the digital twin to a dataset version; print fitted vs prior (vs stand-in truth), intervals
    (all of them hold the truth together with 95%), sensitivity and the misfit."""
    from flows.steps import calibrate_step, dataset_store
    from stages.twin.search import FITTED
    from stages.twin.calibration_config import CalibrateConfig

    check_task(task)
    ws = Workspace.from_env()
    store = dataset_store(ws, task)
    try:
        ds = store.latest() if dataset == "latest" else store.version(dataset)
    except KeyError as e:
        fail(f"--dataset: {str(e).strip(chr(34))}")
    if ds is None:
        fail(f"no dataset for {task!r} in {store.root}; run `sim2edge collect` first")
    cfg = CalibrateConfig(generations=generations, max_latency=max_latency, seed=seed)
    twin = calibrate_step(standalone_run(ws, task), cfg, ds, ws.home / "twins" / store.task.name / f"v{ds.version:04d}")
    spec = json.loads(twin.path.read_text())
    truth = spec.get("standin_truth")
    table = Table("parameter", "prior", "fitted", "95% interval (jointly)", "sensitivity", *(["stand-in truth"] if truth else []),
                  title=f"twin of {task} on dataset v{ds.version:04d}")
    span = lambda name: "{:.4g} – {:.4g}".format(*twin.intervals[name]) if name in twin.intervals else ""  # noqa: E731
    for name in (*FITTED, "latency_steps", "obs_noise"):
        fitted = "prior (unidentifiable)" if name in twin.unidentified else f"{spec['params'][name]:.4g}"
        sens = spec["sensitivity"].get(name)
        table.add_row(name, f"{spec['prior'][name]:.4g}", fitted, span(name),
                      f"{sens:.3g}" if sens is not None else "", *([f"{truth[name]:.4g}"] if truth else []))
    weak = set(spec["weakly_identified"])
    for name in (n for n in twin.intervals if "." in n):  # per joint: multipliers on the global fit
        field, joint = name.split(".", 1)
        fitted = f"{spec['params'][field][joint]:.4g}" + (" (weak)" if name in weak else "")
        table.add_row(name, "1", fitted, span(name), "", *([""] if truth else []))
    console.print(table)
    console.print(f"replay error {twin.replay_error_before:.4g} → {twin.replay_error_after:.4g} "
                  f"({twin.replay_error_before / twin.replay_error_after:.1f}× lower, {twin.misfit.ratio:.2f}× the "
                  f"noise floor); twin {twin.path}, identified MJCF {twin.path.with_name('twin.xml')}", soft_wrap=True)
    if twin.misfit.worst_joints:
        console.print(f"misfit: the model cannot explain the logs on {', '.join(twin.misfit.worst_joints)}",
                      soft_wrap=True)



def evaluate(
    policy: Optional[str] = typer.Argument(None, help="A registered version: NAME@ALIAS or NAME@VERSION."),
    bundle: Optional[Path] = typer.Option(None, help="A bundle file instead (its signature is checked)."),
    trust: Optional[Path] = typer.Option(None, help="Public key for --bundle (default: the workspace's)."),
    twin: Optional[Path] = typer.Option(None, help="twin.json (default: the version's own twin; nominal for a bundle)."),
    suite: Optional[Path] = typer.Option(None, help="Scenario suite file (default: the task's)."),
    episodes: Optional[int] = typer.Option(None, help="Episodes per scenario (default: the suite's; 4 with --hil)."),
    seed: int = typer.Option(1000),
    video: bool = typer.Option(True, help="Render the nominal and worst episodes into the report."),
    hil: list[str] = typer.Option([], "--hil", help="Hardware-in-the-loop: the device serving this policy "
                                  "(sim2edge-agent run), udp://HOST:PORT or unix:///PATH; repeatable: the suite is "
                                  "sharded across the devices, which run concurrently."),
    scenario: list[str] = typer.Option([], "--scenario", help="With --hil: run only this scenario (repeatable)."),
    max_steps: Optional[int] = typer.Option(None, min=1, help="With --hil: control steps per episode "
                                                               "(default: the task's)."),
    out: Optional[Path] = typer.Option(None, help="With --hil: the JSON result file (default: under the workspace)."),
    dead_after: int = typer.Option(25, min=2, metavar="PERIODS", help="With --hil: stop the run once a device has sent "
                                   "no action for this many consecutive periods of an episode."),
    hil_gate: Optional[Path] = typer.Option(None, help="With --hil: YAML of HIL gate floors (HilGateConfig's keys) "
                                                       "over the defaults."),
) -> None:
    """Run the scenario suite on a registered version or a bundle; log the report to MLflow and print the gate.

    With --hil the suite runs in real time against the device (several --hil: sharded across them, concurrently)
    and in-process on the same seeds, side by side, under the HIL gate (deadline misses, round trip, return
    non-inferior to in-process)."""
    import tempfile

    if hil:
        from flows.cli_hil import hil_config

        hil_cfg = hil_config(hil, episodes, seed, max_steps, suite, scenario, dead_after)

    from edge import bundle as bundle_format, signing
    from edge.errors import CheckFailed
    from registry import lineage
    from registry.tracking import stage_run
    from stages.artifacts import ExportedPolicy
    from stages.twin.twin_files import twin_from_file
    from stages.twin.evaluate import EvalConfig, evaluate as run_suite
    from stages.twin.gate import GateConfig

    ws = Workspace.from_env()
    work = Path(tempfile.mkdtemp(prefix="evaluate-", dir=ws.home))
    if (policy is None) == (bundle is None):
        fail("give NAME@ALIAS|NAME@VERSION or --bundle FILE (one of them)")
    if bundle is not None:
        try:
            manifest = bundle_format.extract(bundle, work / "bundle", 1 << 30,
                                             trusted=signing.load_trusted([trust or ws.keys_dir / "signing.pub"]))
        except (CheckFailed, OSError, ValueError) as e:  # the agent's own refusal names the check
            fail(f"--bundle {bundle}: {e}")
        onnx, task, label = work / "bundle" / "policy.onnx", manifest["policy"]["task"], f"bundle {bundle.name}"
        graph = manifest["files"]["policy.onnx"]["sha256"]
    else:
        from mlflow.tracking import MlflowClient

        name, _, ref = policy.partition("@")
        client = MlflowClient(ws.tracking_uri())
        try:
            version = client.get_model_version(name, ref) if ref.isdigit() else client.get_model_version_by_alias(name, ref)
        except Exception as e:
            fail(f"{policy}: no such registered version ({e})")
        onnx = lineage.stage_artifact(client, version, "export", "onnx/policy.onnx", work / "onnx")
        twin = twin or lineage.stage_artifact(client, version, "calibrate", "twin/twin.json", work / "twin")
        task, label, graph = version_task(version), f"{name} v{version.version}", None
    spec = twin_from_file(twin, task)
    if hil:
        from flows.cli_hil import run_hil_suite

        return run_hil_suite(hil_cfg, hil_gate, onnx, task, spec.params, label, out or ws.home / "evaluations" /
                             f"hil-{time.strftime('%Y%m%d-%H%M%S')}.json", graph)
    exported = ExportedPolicy(path=onnx, digest=bundle_format.sha256_path(onnx), task=task, opset=0,
                              parity_max_abs_error=0.0, golden=onnx)
    cfg = EvalConfig(episodes=episodes, seed=seed, suite=suite, video=video)
    try:
        cfg.load_suite(task)
    except ValueError as e:
        fail(str(e))
    with stage_run(standalone_run(ws, task), "evaluate", {**cfg.model_dump(), "policy": label}) as run:
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
        fail(f"{version.name} v{version.version} was trained on task {task!r}, which cannot be loaded here ({e})")
    if tags.get("sim2edge.task_sha256") not in (None, digest):
        console.print(f"warning: the source of {ref} changed since {version.name} v{version.version} was registered",
                      markup=False, highlight=False)
    return task
