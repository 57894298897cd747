"""``sim-to-edge``: collect → calibrate → train → export → evaluate → package → register."""

from __future__ import annotations

import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from rich.progress import Progress

from flows.params import PipelineParams, PipelineSummary, SimToEdgeParams
from flows.steps import calibrate_step, collect_step
from flows.workspace import Workspace
from edge.runtime import OnnxRuntime
from registry import lineage, models
from registry.tracking import RunContext, finish_pipeline, stage_run, start_pipeline
from stages.artifacts import BundleArtifact, Checkpoint, Dataset, EvalReport, ExportedPolicy, TwinSpec
from stages.collect.ingest import StandinConfig
from stages.export import ExportConfig, export
from stages.package import PackageConfig, manifest_for, package
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.standin import LABEL
from stages.train import TrainConfig, train
from stages.twin.calibrate import CalibrateConfig
from stages.twin.evaluate import Champion, EvalConfig, evaluate

@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the wall time of the block under ``name``."""
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 2)


@task(cache_policy=NO_CACHE)
def collect_stage(ctx: RunContext, ws: Workspace, task_ref: str, cfg: StandinConfig) -> Dataset:
    return collect_step(ctx, ws, task_ref, "standin", cfg).dataset


@task(cache_policy=NO_CACHE)
def calibrate_stage(ctx: RunContext, cfg: CalibrateConfig, dataset: Dataset, out: Path) -> TwinSpec:
    return calibrate_step(ctx, cfg, dataset, out)


@task(cache_policy=NO_CACHE)
def train_stage(ctx: RunContext, cfg: TrainConfig, twin: PhysicalParams, out: Path,
                warm_start: Optional[Path] = None) -> Checkpoint:
    with stage_run(ctx, "train", {**cfg.model_dump(), "warm_start": warm_start}) as run, Progress(transient=True) as bar:
        job = bar.add_task(f"PPO {cfg.task}", total=cfg.iterations)

        def report(it: int, metrics: dict[str, float]) -> None:
            run.metrics(metrics, step=it)
            bar.update(job, advance=1, description=f"PPO {cfg.task} return {metrics['mean_return']:.1f}")

        ckpt = train(cfg, twin, out, on_iteration=report, warm_start=warm_start)
        run.artifact(ckpt.path, "checkpoint")
        return ckpt


@task(cache_policy=NO_CACHE)
def export_stage(ctx: RunContext, cfg: ExportConfig, ckpt: Checkpoint, out: Path) -> ExportedPolicy:
    with stage_run(ctx, "export", cfg.model_dump()) as run:
        policy = export(cfg, ckpt, out)
        run.metrics({"parity_max_abs_error": policy.parity_max_abs_error})
        run.artifact(out, "onnx")
        return policy


@task(cache_policy=NO_CACHE)
def evaluate_stage(ctx: RunContext, cfg: EvalConfig, params: PipelineParams, policy: ExportedPolicy,
                   twin: TwinSpec, out: Path, champion: Optional[Champion] = None) -> EvalReport:
    with stage_run(ctx, "evaluate", {**cfg.model_dump(), **params.gate.model_dump(),
                                     "champion": champion.version if champion else None}) as run:
        report = evaluate(cfg, params.gate, policy, twin, out, champion)
        run.metrics({"success_rate": report.success_rate, "mean_return": report.mean_return,
                     **({"champion_mean_return": report.champion_mean_return} if champion else {})})
        run.tags({"sim2edge.gate": "pass" if report.passed else "fail"})
        run.artifact(report.path, "evaluation")
        return report


@task(cache_policy=NO_CACHE)
def package_and_register(ctx: RunContext, params: PipelineParams, ws: Workspace, ds: Dataset, twin: TwinSpec,
                         ckpt: Checkpoint, policy: ExportedPolicy, report: EvalReport, out: Path) -> tuple[BundleArtifact, str, str]:
    """Reserve a model version, write the signed bundle for it, log it, then tag and move the alias."""
    cfg = PackageConfig(target=params.target)
    client = ctx.client
    with stage_run(ctx, "package", cfg.model_dump()) as run:
        version = models.reserve_version(client, params.policy_name, run.run_id, run.artifact_uri + "/bundle",
                                         {"sim2edge.target": cfg.target})
        try:
            provenance = {"mlflow_run_id": ctx.parent_run_id, "package_run_id": run.run_id,
                          "model_version": version, "git_commit": _git_commit()}
            manifest = manifest_for(cfg, params.policy_name, version, policy, report, ckpt, twin, ds, provenance)
            bundle = package(cfg, manifest, policy, ws.keys_dir, out / "bundle.tar")
            run.artifact(bundle.path, "bundle")
            run.tags({"sim2edge.bundle_sha256": bundle.digest, "sim2edge.model_version": version})
            bundle_path = models.proxy_path(run.artifact_uri + "/bundle/bundle.tar", ws.artifact_root())
        except BaseException:
            client.delete_model_version(params.policy_name, version)
            raise
    with stage_run(ctx, "register", {"model": params.policy_name, "version": version}) as run:
        alias = models.publish(client, params.policy_name, version, bundle_path, bundle.digest, bundle.path.stat().st_size,
                               report.passed and params.promote,
                               {"sim2edge.success_rate": report.success_rate, "sim2edge.mean_return": report.mean_return,
                                "sim2edge.dataset_digest": ds.digest, "sim2edge.twin_digest": twin.digest,
                                "sim2edge.pipeline_run_id": ctx.parent_run_id})
        run.tags({"sim2edge.alias": alias})
    return bundle, version, alias


def _git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return out.stdout.strip() or "unknown"


def pull_command(policy: str, alias: str, ws: Workspace, tracking_uri: str) -> str:
    registry = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return (f"sim2edge-agent pull {policy}@{alias} --registry {registry} --root {ws.device_root} "
            f"--trust {ws.keys_dir / 'signing.pub'} --skip-target-check")


def champion_for(ctx: RunContext, name: str, obs_dim: int, out: Path) -> tuple[Optional[Champion], Optional[Path]]:
    """The current champion's ONNX (for the paired comparison) and checkpoint (for warm starts), if any.

    A champion whose policy takes a different observation size (the task changed) is not comparable: None.
    """
    version = lineage.champion(ctx.client, name)
    if version is None:
        return None, None
    onnx = lineage.stage_artifact(ctx.client, version, "export", "onnx/policy.onnx", out / "onnx")
    checkpoint = lineage.stage_artifact(ctx.client, version, "train", "checkpoint/model.pt", out / "checkpoint")
    if OnnxRuntime(onnx).session.get_inputs()[0].shape[-1] != obs_dim:
        print(f"champion v{version.version} takes a different observation size; not compared")
        return None, None
    return Champion(version=version.version, onnx=onnx), checkpoint


def twin_to_registry(ctx: RunContext, ws: Workspace, params: PipelineParams, ds: Dataset, out: Path,
                     timings: dict[str, float], warm_start: bool) -> tuple[PipelineSummary, EvalReport]:
    """calibrate → train (optionally from the champion) → export → evaluate (vs the champion) → package → register."""
    with timed(timings, "calibrate"):
        twin = calibrate_stage(ctx, CalibrateConfig(seed=params.seed), ds, out / "twin")
    champion, champion_ckpt = champion_for(ctx, params.policy_name, load(params.task).obs_dim, out / "champion")
    start_from = champion_ckpt if warm_start else None
    with timed(timings, "train"):
        ckpt = train_stage(ctx, TrainConfig(task=params.task, iterations=params.iterations,
                                            num_envs=params.num_envs, seed=params.seed), twin.params, out / "checkpoint",
                           start_from)
    with timed(timings, "export"):
        policy = export_stage(ctx, ExportConfig(seed=params.seed), ckpt, out / "onnx")
    with timed(timings, "evaluate"):
        report = evaluate_stage(ctx, EvalConfig(episodes=params.eval_episodes, seed=params.seed + 1000), params,
                                policy, twin, out / "evaluation", champion)
    with timed(timings, "package + register"):
        bundle, version, alias = package_and_register(ctx, params, ws, ds, twin, ckpt, policy, report, out / "bundle")
    summary = PipelineSummary(
        policy=params.policy_name, version=version, alias=alias, success_rate=report.success_rate,
        mean_return=report.mean_return, gate_reasons=report.reasons, bundle_sha256=bundle.digest,
        mlflow_run_id=ctx.parent_run_id, tracking_uri=ctx.tracking_uri,
        pull_command=pull_command(params.policy_name, alias, ws, ctx.tracking_uri), stage_seconds=timings,
        dataset_version=ds.version, warm_started_from=champion.version if champion and start_from else None,
        compared_with=champion.version if champion else None,
    )
    return summary, report


@flow(name="sim-to-edge", log_prints=True)
def sim_to_edge(params: SimToEdgeParams = SimToEdgeParams()) -> PipelineSummary:
    """The whole chain for one task and target, tracked in MLflow, ending in a registered bundle."""
    ws = Workspace.from_env()
    ctx = start_pipeline(ws.tracking_uri(), f"sim2edge/{params.policy_name}", ws.artifact_root(),
                         f"sim-to-edge {params.policy_name}",
                         {"sim2edge.task": params.task, "sim2edge.target": params.target, "sim2edge.robot": LABEL})
    out = ws.runs / ctx.parent_run_id
    timings: dict[str, float] = {}
    try:
        with timed(timings, "collect"):
            ds = collect_stage(ctx, ws, params.task, StandinConfig(episodes=params.collect_episodes, seed=params.seed))
        summary, _ = twin_to_registry(ctx, ws, params, ds, out, timings, warm_start=False)
    except BaseException:
        finish_pipeline(ctx, ok=False)
        raise
    finish_pipeline(ctx, ok=True)
    create_markdown_artifact(key="sim-to-edge-summary", markdown=summary_markdown(summary),
                             description=f"{summary.policy} v{summary.version} → {summary.alias}")
    return summary


def summary_markdown(s: PipelineSummary) -> str:
    rows = "\n".join(f"| {k} | {v:.1f} s |" for k, v in s.stage_seconds.items())
    gate = "\n".join(f"- {r}" for r in s.gate_reasons)
    lineage_line = (f"Dataset v{s.dataset_version:04d}"
                    + (f"; warm-started from v{s.warm_started_from}" if s.warm_started_from else "")
                    + (f"; compared with champion v{s.compared_with} on the same seeds" if s.compared_with else ""))
    return (f"# {s.policy} v{s.version} → `{s.alias}`\n\n"
            f"Success rate {s.success_rate:.2f}, mean return {s.mean_return:.1f}\n\n{lineage_line}\n\n{gate}\n\n"
            f"| stage | time |\n|---|---|\n{rows}\n\n"
            f"MLflow run `{s.mlflow_run_id}` on {s.tracking_uri}\n\nBundle sha256 `{s.bundle_sha256}`\n\n"
            f"```\n{s.pull_command}\n```\n")
