"""The task runner that fans out evaluation shards, chosen per deployment by ``SIM2EDGE_TASK_RUNNER``.

``threads`` (default): a thread pool in the flow's process (MuJoCo and ONNX Runtime release the GIL).
``ray``: a local Ray cluster started for the flow run; ``ray://host:10001``: an existing Ray cluster
(``prefect-ray``, installed with ``sim2edge[cluster]``). Set it in a deployment's job variables
(``env: {SIM2EDGE_TASK_RUNNER: ray://…}``) or in the environment of ``sim2edge serve``.
"""

from __future__ import annotations

import os

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner


def task_runner(spec: str | None = None) -> TaskRunner:
    spec = spec or os.environ.get("SIM2EDGE_TASK_RUNNER", "threads")
    if spec == "threads":
        return ThreadPoolTaskRunner(max_workers=os.cpu_count() or 2)
    if spec == "ray" or spec.startswith("ray://"):
        from prefect_ray import RayTaskRunner

        if spec == "ray":
            return RayTaskRunner(init_kwargs={"include_dashboard": False})
        return RayTaskRunner(address=spec)
    raise ValueError(f"SIM2EDGE_TASK_RUNNER={spec!r}: use threads, ray or ray://host:port")
