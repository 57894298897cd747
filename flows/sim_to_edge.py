"""``sim-to-edge``: collect → calibrate → train → export → evaluate → package → register.

With ``dataset_version`` the run starts from that version of the task's dataset (collected beforehand, e.g. from a
rosbag) instead of recording stand-in logs: no collect stage; the parent run is tagged ``sim2edge.dataset_version``."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.chain import begin_pipeline, summary_markdown, twin_to_registry
from flows.params import PipelineSummary, SimToEdgeParams
from flows.stage_tasks import collect_stage, timed
from flows.steps import existing_dataset
from flows.runners import task_runner
from flows.workspace import Workspace
from registry.tracking import finish_pipeline
from stages.collect.ingest import StandinConfig
from stages.standin import LABEL


@flow(name="sim-to-edge", log_prints=True, task_runner=task_runner())
def sim_to_edge(params: SimToEdgeParams = SimToEdgeParams()) -> PipelineSummary:
    """The whole chain for one task and target, tracked in MLflow, ending in a registered bundle."""
    ws = Workspace.from_env()
    ctx = begin_pipeline(ws, params, f"sim-to-edge {params.policy_name}",
                         {"sim2edge.task": params.task, "sim2edge.target": params.target, "sim2edge.robot": LABEL})
    out = ws.runs / ctx.parent_run_id
    timings: dict[str, float] = {}
    try:
        if params.dataset_version is None:
            with timed(timings, "collect"):
                ds = collect_stage(ctx, ws, params.task, StandinConfig(episodes=params.collect_episodes, seed=params.seed))
        else:
            ds = existing_dataset(ws, params.task, params.dataset_version)
            ctx.client.set_tag(ctx.parent_run_id, "sim2edge.dataset_version", f"v{ds.version:04d}")
            print(f"dataset {ds.task} v{ds.version:04d} ({ds.source}): {ds.episodes} episodes, {ds.rows} rows; no collect")
        summary = twin_to_registry(ctx, ws, params, ds, out, timings, warm_start=False)
    except BaseException:
        finish_pipeline(ctx, ok=False)
        raise
    finish_pipeline(ctx, ok=True)
    create_markdown_artifact(key="sim-to-edge-summary", markdown=summary_markdown(summary),
                             description=f"{summary.policy} v{summary.version} → {summary.alias}")
    return summary
