"""``nightly-retrain``: new telemetry → recalibrate → warm-start from the champion → evaluate against
the champion on the same seeds → promote only if every gate passes → package."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from flows.params import NightlyParams, PipelineSummary
from flows.chain import begin_pipeline, summary_markdown, twin_to_registry
from flows.stage_tasks import REGISTRY_IO, timed
from flows.steps import collect_step
from flows.runners import task_runner
from flows.workspace import Workspace
from registry.tracking import RunContext, finish_pipeline
from stages.collect.store import IngestReport


@task(**REGISTRY_IO)
def ingest_stage(ctx: RunContext, ws: Workspace, params: NightlyParams) -> IngestReport:
    return collect_step(ctx, ws, params.task, params.source, folder=Path(params.folder) if params.folder else None)


@flow(name="nightly-retrain", log_prints=True, task_runner=task_runner())
def nightly_retrain(params: NightlyParams = NightlyParams()) -> Optional[PipelineSummary]:
    """Retrain on what the robots logged since the last run; None when skipped for lack of new data."""
    ws = Workspace.from_env()
    ctx = begin_pipeline(ws, params, f"nightly-retrain {params.policy_name}",
                         {"sim2edge.task": params.task, "sim2edge.target": params.target, "sim2edge.flow": "nightly-retrain"})
    out = ws.runs / ctx.parent_run_id
    timings: dict[str, float] = {}
    try:
        with timed(timings, "ingest"):
            ingest = ingest_stage(ctx, ws, params)
        if not ingest.new_version and params.no_new_data == "skip":
            ctx.client.set_tag(ctx.parent_run_id, "sim2edge.nightly", "skipped: no new telemetry")
            finish_pipeline(ctx, ok=True)
            message = (f"# nightly-retrain {params.policy_name}: skipped\n\nNo new telemetry since the last watermark "
                       f"(dataset stays v{ingest.dataset.version:04d}); `no_new_data` is `skip`. No alias moved.\n")
            create_markdown_artifact(key="nightly-retrain-summary", markdown=message, description="skipped: no new data")
            print(message)
            return None
        ctx.client.set_tag(ctx.parent_run_id, "sim2edge.nightly",
                           "new telemetry" if ingest.new_version else "retrained without new telemetry")
        summary = twin_to_registry(ctx, ws, params, ingest.dataset, out, timings, warm_start=params.warm_start)
    except BaseException:
        finish_pipeline(ctx, ok=False)
        raise
    finish_pipeline(ctx, ok=True)
    create_markdown_artifact(key="nightly-retrain-summary", markdown=summary_markdown(summary),
                             description=f"{summary.policy} v{summary.version} → {summary.alias}")
    return summary
