"""The chain both flows share after collection: calibrate → train → export → evaluate → package → register."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from edge.runtime import OnnxRuntime
from flows.gate import log_gate
from flows.params import PipelineParams, PipelineSummary
from flows.stage_tasks import (calibrate_stage, evaluate_shard, evaluate_stage, export_stage, metric_name,
                               package_and_register, publish_stage, timed, train_stage)
from flows.workspace import Workspace
from registry import lineage
from mlflow.entities.model_registry import ModelVersion
from prefect import unmapped

from registry.tracking import RunContext, fail_orphans, log_metrics, start_pipeline
from stages.artifacts import Checkpoint, Dataset, TwinSpec, remove_partial
from stages.export import ExportConfig
from stages.sim.registry import load
from stages.train_config import TrainConfig
from stages.twin.calibration_config import CalibrateConfig
from stages.sim.params import PhysicalParams
from stages.twin.evaluate import Champion, EvalConfig, Shard, shard_jobs
from stages.twin.gate import Check


def begin_pipeline(ws: Workspace, params: PipelineParams, run_name: str, tags: dict[str, str]) -> RunContext:
    """Start a pipeline run in experiment ``sim2edge/<model name>``, with ``params`` as its parameters; first mark
    FAILED the runs a killed process left RUNNING, and delete their partial outputs."""
    ctx = start_pipeline(ws.tracking_uri(), f"sim2edge/{params.policy_name}", ws.artifact_root(), run_name, tags,
                         params.model_dump())
    ctx.client.log_text(ctx.parent_run_id, yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False),
                        "run_config.yaml")  # the resolved configuration: `sim2edge run --config` takes it back
    for run_id in fail_orphans(ctx.client, ctx.experiment_id):  # this run's owner is alive: never among them
        for partial in remove_partial(ws.runs / run_id):
            print(f"removed the partial output {partial} of killed run {run_id}")
    return ctx


def record(ctx: RunContext, stage: str, out: Path, result: Any, rerun: Callable[[], Any]) -> Any:
    """Check a stage's (possibly cached) result and note on the pipeline run which stage run made it.

    A cached result whose files are gone is recomputed (``rerun``); one from an earlier pipeline run
    is tagged ``sim2edge.reused.<stage>`` with that run."""
    if not Path(result.path).exists():
        result = rerun()
    if result.run_id:
        ctx.client.set_tag(ctx.parent_run_id, f"sim2edge.stage_run.{stage}", result.run_id)
    path = Path(result.path).resolve()
    if not path.is_relative_to(out.resolve()):
        runs = out.resolve().parent
        origin = path.relative_to(runs).parts[0] if path.is_relative_to(runs) else str(path)
        ctx.client.set_tag(ctx.parent_run_id, f"sim2edge.reused.{stage}", origin)
        print(f"{stage}: unchanged inputs, reused the result of pipeline run {origin}")
    return result


def cached(ctx: RunContext, stage: str, out: Path, call: Callable[..., Any], *args: Any) -> Any:
    """Run a cached stage task and :func:`record` its result."""
    return record(ctx, stage, out, call(*args), lambda: call.with_options(refresh_cache=True)(*args))


def over_twin(cfg: TrainConfig, twin: TwinSpec) -> TrainConfig:
    """``cfg`` randomizing over the twin's intervals: what the twin does not know. An unidentified parameter's interval
    (its whole search range) is left out: it keeps the task's own range."""
    known = {k: v for k, v in twin.intervals.items() if k not in twin.unidentified}
    return cfg.model_copy(update={"twin_intervals": known})


def train_seeds(ctx: RunContext, params: PipelineParams, spec: TwinSpec, out: Path,
                start_from: Optional[Path]) -> Checkpoint:
    """Train ``params.train_seeds`` seeds over the flow's task runner, randomized over the twin's intervals; keep the
    best final training return."""
    twin = spec.params
    cfgs = [over_twin(TrainConfig(task=params.task, iterations=params.iterations, num_envs=params.num_envs,
                                  seed=params.seed + k, **params.train.model_dump()), spec)
            for k in range(params.train_seeds)]
    if len(cfgs) == 1:
        return cached(ctx, "train", out, train_stage, ctx, cfgs[0], twin, out / "checkpoint", start_from)
    outs = [out / f"checkpoint-seed{c.seed}" for c in cfgs]
    futures = train_stage.map(unmapped(ctx), cfgs, unmapped(twin), outs, unmapped(start_from), progress=unmapped(False))
    ckpts = [f.result() for f in futures]
    best = max(range(len(ckpts)), key=lambda i: ckpts[i].final_return)
    ctx.client.set_tag(ctx.parent_run_id, "sim2edge.train_seeds",
                       json.dumps({c.seed: k.final_return for c, k in zip(cfgs, ckpts)}))
    return record(ctx, "train", out, ckpts[best],
                  lambda: train_stage.with_options(refresh_cache=True)(ctx, cfgs[best], twin, outs[best], start_from, False))


def fan_out(cfg: EvalConfig, onnx: Path, champion: Optional[Champion], task_ref: str,
            params: PhysicalParams) -> tuple[list[Shard], Optional[list[Shard]]]:
    """Run the challenger's (and the champion's) evaluation shards through the flow's task runner."""
    suite = cfg.load_suite(task_ref)
    jobs = shard_jobs(cfg, suite, onnx) + (shard_jobs(cfg, suite, champion.onnx) if champion else [])
    results = [f.result() for f in evaluate_shard.map(jobs, task_ref=unmapped(task_ref), params=unmapped(params))]
    n = len(results) // (2 if champion else 1)
    return results[:n], (results[n:] if champion else None)


def champion_for(ctx: RunContext, version: Optional[ModelVersion], obs_dim: int,
                 out: Path) -> tuple[Optional[Champion], Optional[Path]]:
    """The champion ``version``'s ONNX (for the paired comparison) and checkpoint (for warm starts), if any.

    A champion whose policy takes a different observation size (the task changed) is not comparable: None.
    """
    if version is None:
        return None, None
    onnx = lineage.stage_artifact(ctx.client, version, "export", "onnx/policy.onnx", out / "onnx")
    checkpoint = lineage.stage_artifact(ctx.client, version, "train", "checkpoint/model.pt", out / "checkpoint")
    if OnnxRuntime(onnx).session.get_inputs()[0].shape[-1] != obs_dim:
        print(f"champion v{version.version} takes a different observation size; not compared")
        return None, None
    return Champion(version=version.version, onnx=onnx), checkpoint


def twin_to_registry(ctx: RunContext, ws: Workspace, params: PipelineParams, ds: Dataset, out: Path,
                     timings: dict[str, float], warm_start: bool) -> PipelineSummary:
    """calibrate → train (optionally from the champion) → export → evaluate (vs the champion) → package →
    hil_evaluate (when ``params.hil``) → register → publish (a new champion, when ``params.publish``)."""
    with timed(timings, "calibrate"):
        cfg = CalibrateConfig(**params.calibrate.model_dump(), seed=params.seed)
        twin = cached(ctx, "calibrate", out, calibrate_stage, ctx, cfg, ds, out / "twin")
    seen = lineage.champion(ctx.client, params.policy_name)  # only this one may be replaced
    champion, champion_ckpt = champion_for(ctx, seen, load(params.task).obs_dim, out / "champion")
    start_from = champion_ckpt if warm_start else None
    with timed(timings, "train"):
        ckpt = train_seeds(ctx, params, twin, out, start_from)
    with timed(timings, "export"):
        policy = cached(ctx, "export", out, export_stage, ctx, ExportConfig(seed=params.seed), ckpt, out / "onnx")
    with timed(timings, "evaluate"):
        cfg = EvalConfig(episodes=params.eval_episodes, seed=params.seed + 1000)
        shards, champion_shards = fan_out(cfg, policy.path, champion, params.task, twin.params)
        report = cached(ctx, "evaluate", out, evaluate_stage, ctx, cfg, params, policy, twin, out / "evaluation",
                        champion, shards, champion_shards)
    with timed(timings, "package + register"):
        bundle, version, alias, hil = package_and_register(ctx, params, ws, ds, twin, ckpt, policy, report, out / "bundle",
                                                      seen.version if seen else None)
    if params.publish is not None and alias == "champion":
        with timed(timings, "publish"):
            publish_stage(ctx, params, ws, bundle, version)
    summary = PipelineSummary(
        policy=params.policy_name, version=version, alias=alias, success_rate=report.success_rate,
        mean_return=report.mean_return, gate_reasons=report.reasons,
        gate_checks=tuple(Check(**c) for c in json.loads(report.path.read_text())["checks"]),
        hil_checks=hil.checks if hil else (), bundle_sha256=bundle.digest,
        mlflow_run_id=ctx.parent_run_id, tracking_uri=ctx.tracking_uri,
        pull_command=pull_command(params.policy_name, alias, ws, ctx.tracking_uri,
                                  tuple(r for r in report.reasons if not r.startswith("pass"))
                                  + tuple(c.name for c in (hil.checks if hil else ()) if not c.passed)),
        stage_seconds=timings,
        dataset_version=ds.version, warm_started_from=champion.version if champion and start_from else None,
        compared_with=champion.version if champion else None, champion_mean_return=report.champion_mean_return,
        champion_success_rate=report.champion_success_rate, mlflow_experiment_id=ctx.experiment_id,
        scenarios=report.scenarios, sim_to_real_gap=report.sim_to_real_gap,
    )
    log_results(ctx, summary)
    return summary


def headline_metrics(s: PipelineSummary) -> dict[str, float]:
    """What the runs table compares pipelines by: the gate, success and return (overall and per scenario),
    the champion's figures on the same seeds, the sim-to-real gap and the stage times."""
    values = {"gate_passed": float(all(r.startswith("pass") for r in s.gate_reasons)),
              "promoted": float(s.alias == "champion"), "success_rate": s.success_rate, "mean_return": s.mean_return,
              **{f"success_rate.{metric_name(r.name)}": r.success_rate for r in s.scenarios},
              **{f"mean_return.{metric_name(r.name)}": r.mean_return for r in s.scenarios},
              **{f"sim_to_real_rmse.{metric_name(k)}": v for k, v in (s.sim_to_real_gap or {}).items()},
              **{f"seconds.{metric_name(k)}": v for k, v in s.stage_seconds.items()},
              **({"hil_gate_passed": float(all(c.passed for c in s.hil_checks))} if s.hil_checks else {}),
              "seconds.total": sum(s.stage_seconds.values())}
    if s.compared_with:
        values.update(champion_success_rate=s.champion_success_rate, champion_mean_return=s.champion_mean_return)
    return {k: v for k, v in values.items() if v is not None}


def log_results(ctx: RunContext, s: PipelineSummary) -> None:
    """The headline results on the pipeline's parent run: metrics, every gate clause (``gate.json``), and the
    version and alias it made as tags."""
    log_metrics(ctx.client, ctx.parent_run_id, headline_metrics(s))
    log_gate(ctx.client, ctx.parent_run_id, s.gate_checks)
    for k, v in {"sim2edge.model_version": s.version, "sim2edge.alias": s.alias, "sim2edge.model": s.policy}.items():
        ctx.client.set_tag(ctx.parent_run_id, k, v)


def pull_command(policy: str, alias: str, ws: Workspace, tracking_uri: str, failed: tuple[str, ...] = ()) -> str:
    """The agent command that installs this version; for a version that failed its gate (``failed``: the
    failing checks) it says why and adds ``--allow-failed-gate``, without which the agent refuses it."""
    registry = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    command = (f"sim2edge-agent pull {policy}@{alias} --registry {registry} --root {ws.device_root} "
               f"--trust {ws.keys_dir / 'signing.pub'} --skip-target-check")
    if not failed:
        return command
    return (f"# {policy}@{alias} failed its evaluation gate ({'; '.join(failed)}); the agent installs it only "
            f"with --allow-failed-gate\n{command} --allow-failed-gate")


def summary_markdown(s: PipelineSummary) -> str:
    """The flow run's Prefect artifact: decision, evaluation and gate tables, timings, lineage, links."""
    champion = f"v{s.compared_with}" if s.compared_with else "none"
    def cell(v: Optional[float], fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    evaluation = (f"| scenario | success v{s.version} | success {champion} | return v{s.version} | return {champion} |\n"
                  "|---|---|---|---|---|\n" + "\n".join(
                      f"| {r.name} | {r.success_rate:.2f} (≥{r.success_low:.2f}) | {cell(r.champion_success_rate, '.2f')} "
                      f"| {r.mean_return:.1f} | {cell(r.champion_mean_return, '.1f')} |" for r in s.scenarios))
    if s.sim_to_real_gap:
        evaluation += ("\n\nSim-to-real (joint-trajectory RMSE to the stand-in robot): calibrated twin "
                       f"{s.sim_to_real_gap['twin']:.4f}, uncalibrated model {s.sim_to_real_gap['uncalibrated']:.4f}")
    # words, not only emoji: without an emoji font both render as the same box
    gate = "\n".join(f"| {r.split(': ', 1)[1]} | {'pass' if r.startswith('pass') else 'FAIL'} |" for r in s.gate_reasons)
    gate += "".join(f"\n| HIL: {c.name} ({c.detail}) | {'pass' if c.passed else 'FAIL'} |" for c in s.hil_checks)
    rows = "\n".join(f"| {k} | {v:.1f} s |" for k, v in s.stage_seconds.items())
    lineage_line = (f"Dataset v{s.dataset_version:04d}"
                    + (f"; warm-started from v{s.warm_started_from}" if s.warm_started_from else "")
                    + (f"; compared with champion v{s.compared_with} on the same seeds" if s.compared_with else ""))
    run = f"`{s.mlflow_run_id}` on {s.tracking_uri}"
    if s.tracking_uri.startswith("http"):
        run = f"[{s.mlflow_run_id}]({s.tracking_uri}/#/experiments/{s.mlflow_experiment_id}/runs/{s.mlflow_run_id})"
    return (f"# {s.policy} v{s.version} → `{s.alias}`\n\n{lineage_line}\n\n{evaluation}\n\n"
            f"| gate | |\n|---|---|\n{gate}\n\n| stage | time |\n|---|---|\n{rows}\n\n"
            f"MLflow run {run}\n\nBundle sha256 `{s.bundle_sha256}`\n\nPull it onto a device:\n\n"
            f"```\n{s.pull_command}\n```\n")
