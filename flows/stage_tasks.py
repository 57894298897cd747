"""The pipeline's stages as Prefect tasks. Deterministic stages (calibrate, train, export,
evaluate) persist their results under an input-based cache key (``flows/caching.py``), so an
unchanged re-run reuses them and a failed run resumes at the stage that failed. Registry I/O
(collect, package, register) always runs."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.error
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import requests
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff
from rich.progress import Progress

from edge.bundle import sha256_path
from flows.caching import stage_key, task_version
from flows.params import PipelineParams
from flows.promotion import promote_slot
from flows.steps import calibrate_step, collect_step, hil_step
from flows.workspace import Workspace
from registry import models, policy_model
from registry.tracking import RunContext, stage_run
from stages.artifacts import BundleArtifact, Checkpoint, Dataset, EvalReport, ExportedPolicy, TwinSpec
from stages.collect.ingest import StandinConfig
from stages.export import ExportConfig, export
from stages.package import PackageConfig, manifest_for, package
from stages.sim.params import PhysicalParams
from stages.sim.registry import reference as task_reference
from stages.train import train
from stages.train_config import TrainConfig
from stages.twin.calibration_config import CalibrateConfig
from stages.twin.evaluate import Champion, EvalConfig, Shard, ShardJob, evaluate, run_shard
from stages.twin.hil_evaluate import HilReport
from stages.twin.hil_stage import failed_clauses
from registry.tuf_repo import PublishConfig, Published, tag_published
from registry.tuf_repo import publish as publish_tuf


TRANSIENT = (ConnectionError, TimeoutError, urllib.error.URLError, requests.exceptions.ConnectionError,
             requests.exceptions.Timeout)


def transient(task: object, task_run: object, state: object) -> bool:
    """Retry network and registry I/O failures only; a deterministic failure fails at once."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, MlflowException):  # the client's own HTTP retries gave up, or the server is unavailable
        return exc.error_code == "TEMPORARILY_UNAVAILABLE" or any(
            s in str(exc) for s in ("Max retries exceeded", "Connection", "status code 502", "status code 503"))
    return isinstance(exc, TRANSIENT)


REGISTRY_IO = dict(cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=2),
                   retry_condition_fn=transient)


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the wall time of the block under ``name``."""
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 2)


@task(**REGISTRY_IO)
def collect_stage(ctx: RunContext, ws: Workspace, task_ref: str, cfg: StandinConfig) -> Dataset:
    return collect_step(ctx, ws, task_ref, "standin", cfg).dataset


@task(cache_key_fn=stage_key("calibrate", lambda p: [p["cfg"].model_dump(), p["dataset"].digest,
                                                     task_version(p["dataset"].task)]))
def calibrate_stage(ctx: RunContext, cfg: CalibrateConfig, dataset: Dataset, out: Path) -> TwinSpec:
    return calibrate_step(ctx, cfg, dataset, out)


@task(cache_key_fn=stage_key("train", lambda p: [p["cfg"].model_dump(), p["twin"].model_dump(), task_version(p["cfg"].task),
                                             sha256_path(p["warm_start"]) if p.get("warm_start") else None]))
def train_stage(ctx: RunContext, cfg: TrainConfig, twin: PhysicalParams, out: Path,
                warm_start: Optional[Path] = None, progress: bool = True) -> Checkpoint:
    """``progress``: a terminal progress bar (off when several seeds train at once: one live display only)."""
    with stage_run(ctx, "train", {**cfg.model_dump(), "warm_start": warm_start}) as run, \
            Progress(transient=True, disable=not progress) as bar:
        job = bar.add_task(f"PPO {cfg.task}", total=cfg.iterations)

        def report(it: int, metrics: dict[str, float]) -> None:
            run.metrics(metrics, step=it)
            bar.update(job, advance=1, description=f"PPO {cfg.task} return {metrics['mean_return']:.1f}")

        ckpt = train(cfg, twin, out, on_iteration=report, warm_start=warm_start)
        run.artifact(ckpt.path, "checkpoint")
        return ckpt.model_copy(update={"run_id": run.run_id})


@task(cache_key_fn=stage_key("export", lambda p: [p["cfg"].model_dump(), p["ckpt"].digest]))
def export_stage(ctx: RunContext, cfg: ExportConfig, ckpt: Checkpoint, out: Path) -> ExportedPolicy:
    with stage_run(ctx, "export", cfg.model_dump()) as run:
        policy = export(cfg, ckpt, out)
        run.metrics({"parity_max_abs_error": policy.parity_max_abs_error,
                     "golden_unsaturated_fraction": policy.golden_unsaturated_fraction})
        run.artifact(out, "onnx")
        return policy.model_copy(update={"run_id": run.run_id})


def shard_run_name(parameters: dict) -> str:
    """An evaluation shard's task run name in the UI: the policy (task and ONNX digest), scenario and seed."""
    job = parameters["job"]
    return f"evaluate {parameters['task_ref']} policy {sha256_path(job.onnx)[:8]}: {job.scenario.name} seed {job.seed}"


@task(task_run_name=shard_run_name,
      cache_key_fn=stage_key("shard", lambda p: [p["job"].seed, p["job"].episodes, p["job"].scenario.model_dump(),
                                                 sha256_path(p["job"].onnx),
                                                 p["params"].model_dump(), task_version(p["task_ref"])]))
def evaluate_shard(job: ShardJob, task_ref: str, params: PhysicalParams) -> Shard:
    """One batch of evaluation episodes; the flow maps these over its task runner."""
    return run_shard(job, task_ref, params)


@task(cache_key_fn=stage_key("evaluate", lambda p: [
    p["cfg"].model_dump(), p["cfg"].load_suite(p["policy"].task).model_dump(), p["params"].gate.model_dump(), p["policy"].digest, p["twin"].digest,
    task_version(p["policy"].task), sha256_path(p["champion"].onnx) if p.get("champion") else None]))
def evaluate_stage(ctx: RunContext, cfg: EvalConfig, params: PipelineParams, policy: ExportedPolicy,
                   twin: TwinSpec, out: Path, champion: Optional[Champion], shards: list[Shard],
                   champion_shards: Optional[list[Shard]]) -> EvalReport:
    with stage_run(ctx, "evaluate", {**cfg.model_dump(), **params.gate.model_dump(),
                                     "champion": champion.version if champion else None}) as run:
        report = evaluate(cfg, params.gate, policy, twin, out, champion, shards, champion_shards)
        run.metrics({"success_rate": report.success_rate, "mean_return": report.mean_return,
                     "latency_ms_p99": report.latency_ms_p99,
                     **{f"success_rate.{metric_name(s.name)}": s.success_rate for s in report.scenarios},
                     **{f"{k}.{metric_name(s.name)}": v for s in report.scenarios for k, v in s.metrics.items()},
                     **{f"sim_to_real_rmse.{k}": v for k, v in (report.sim_to_real_gap or {}).items()},
                     **({"champion_mean_return": report.champion_mean_return} if champion else {})})
        run.tags({"sim2edge.gate": "pass" if report.passed else "fail"})
        run.artifact(out, "evaluation")
        return report.model_copy(update={"run_id": run.run_id})


@task(**REGISTRY_IO)
def package_and_register(ctx: RunContext, params: PipelineParams, ws: Workspace, ds: Dataset, twin: TwinSpec,
                         ckpt: Checkpoint, policy: ExportedPolicy, report: EvalReport, out: Path,
                         expected_champion: Optional[str]) -> tuple[BundleArtifact, str, str, Optional[HilReport]]:
    """Reserve a model version, write the signed bundle for it, log it, evaluate it over hardware-in-the-loop when
    ``params.hil`` is set, then tag and move the alias (a failing HIL gate keeps it a challenger, tagged why)."""
    cfg = PackageConfig(target=params.target)
    client = ctx.client
    with stage_run(ctx, "package", cfg.model_dump()) as run:
        model = policy_model.create(client, ctx.experiment_id, run.run_id, params.policy_name, {"sim2edge.target": cfg.target})
        version = models.reserve_version(client, params.policy_name, run.run_id, policy_model.version_source(client, model),
                                         {"sim2edge.target": cfg.target}, model_id=model.model_id)
        try:
            provenance = {"mlflow_run_id": ctx.parent_run_id, "package_run_id": run.run_id,
                          "model_version": version, "git_commit": _git_commit()}
            manifest = manifest_for(cfg, params.policy_name, version, policy, report, ckpt, twin, ds, provenance)
            bundle = package(cfg, manifest, policy, ws.keys_dir, out / "bundle.tar")
            run.artifact(bundle.path, "bundle")
            policy_model.upload(client, model, policy.path, policy.golden, bundle.path, manifest)
            run.tags({"sim2edge.bundle_sha256": bundle.digest, "sim2edge.model_version": version})
            bundle_path = models.proxy_path(run.artifact_uri + "/bundle/bundle.tar", ws.artifact_root())
        except BaseException:
            client.delete_model_version(params.policy_name, version)
            client.finalize_logged_model(model.model_id, "FAILED")
            raise
    hil, hil_tags = None, {}
    if params.hil is not None:
        try:
            hil = hil_step(ctx, params.hil, bundle.path, ws.keys_dir / "signing.pub", policy.path, params.task, twin,
                           params.seed + 1000, out / "hil")
        except BaseException as e:
            client.delete_model_version(params.policy_name, version)
            client.finalize_logged_model(model.model_id, "FAILED")
            if isinstance(e, TRANSIENT):  # the device, not the registry: a retry would reserve yet another version
                raise RuntimeError(f"hil_evaluate: device {', '.join(params.hil.devices) or 'local'}: "
                                   f"{type(e).__name__}: {e}") from None
            raise
        hil_tags = {"sim2edge.hil_gate": "pass" if hil.passed else "fail",
                    **({} if hil.passed else {"sim2edge.not_promoted": failed_clauses(hil)})}
    with stage_run(ctx, "register", {"model": params.policy_name, "version": version}) as run, \
            promote_slot(params.policy_name):
        alias = models.publish(client, params.policy_name, version, bundle_path, bundle.digest, bundle.path.stat().st_size,
                               report.passed and (hil is None or hil.passed) and params.promote,
                               {"sim2edge.success_rate": report.success_rate, "sim2edge.mean_return": report.mean_return,
                                "sim2edge.dataset_digest": ds.digest, "sim2edge.twin_digest": twin.digest,
                                "sim2edge.pipeline_run_id": ctx.parent_run_id, **task_tags(params.task), **hil_tags},
                               expected_champion)
        run.tags({"sim2edge.alias": alias})
    return bundle, version, alias, hil


@task(**REGISTRY_IO)
def publish_stage(ctx: RunContext, params: PipelineParams, ws: Workspace, bundle: BundleArtifact,
                  version: str) -> Published:
    """A new champion's bundle into the TUF repository of ``params.publish``; the version tagged with it."""
    settings = params.publish
    keys = Path(settings.key_dir) if settings.key_dir else ws.home / "tuf-keys"
    with stage_run(ctx, "publish", {"repo": settings.repo, "version": version}) as run:
        done = publish_tuf(PublishConfig(repo=Path(settings.repo), keys=keys, bundle=bundle.path,
                                         policy=params.policy_name, version=version))
        tag_published(ctx.client, params.policy_name, version, Path(settings.repo), done)
        run.tags({"sim2edge.tuf_target": done.target_path, "sim2edge.tuf_targets_version": str(done.targets_version)})
    return done


def task_tags(task: str) -> dict[str, str]:
    """A registered version's task: the name it was trained as, its ``module:Class`` and its source digest."""
    ref, digest = task_reference(task)
    return {"sim2edge.task": task, "sim2edge.task_ref": ref, "sim2edge.task_sha256": digest}


def metric_name(text: str) -> str:
    """MLflow metric names take letters, digits, ``_ - . /`` and spaces."""
    return re.sub(r"[^\w./ -]", "_", text)


def _git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return out.stdout.strip() or "unknown"
