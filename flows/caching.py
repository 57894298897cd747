"""Input-based cache keys for the deterministic stages: re-running with unchanged inputs reuses them.

A key is the stage's config, the digests of its input artifacts and the code version: the
digest of ``stages/`` and ``edge/`` (sources and assets) plus the task's own module and MJCF
(a ``module:Class`` task lives outside the repo). Run contexts and output folders are not
part of a key. Registry I/O (collect, package, register) is never cached.
"""

from __future__ import annotations

import hashlib
import inspect
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from stages.artifacts import sha256_json
from stages.sim.registry import load

REPO = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=None)
def code_version() -> str:
    h = hashlib.sha256()
    for folder in ("stages", "edge"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".py", ".xml", ".json") and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(REPO)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=None)
def task_version(task_ref: str) -> str:
    task = load(task_ref)
    source = Path(inspect.getsourcefile(type(task)))
    return hashlib.sha256(source.read_bytes() + task.mjcf.read_bytes()).hexdigest()


def stage_key(stage: str, inputs: Callable[[dict[str, Any]], Any]) -> Callable[[Any, dict[str, Any]], str]:
    """A Prefect ``cache_key_fn``: ``inputs(parameters)`` picks the parts of the call that matter."""

    def key(context: Any, parameters: dict[str, Any]) -> str:
        return sha256_json([stage, code_version(), inputs(parameters)])

    return key

