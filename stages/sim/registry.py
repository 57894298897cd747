"""The one lazy task registry: names map to factories; tasks are built on first use.

Other packages add tasks through the ``sim2edge.tasks`` entry-point group
(``mytask = mypkg.mymodule:MyTask``); those names then appear everywhere a registered name
does (``sim2edge tasks``, the Prefect form's task picker). ``module:Class`` works without one.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from importlib.metadata import entry_points
from typing import Callable

from stages.sim.task import Task

_FACTORIES: dict[str, str | Callable[[], Task]] = {
    "cartpole": "stages.sim.cartpole:CartPole",
    "reacher": "stages.sim.reacher:Reacher",
    "arm6": "stages.sim.arm6:Arm6",
    "quadruped": "stages.sim.quadruped:Quadruped",
}
_BUILT: dict[str, Task] = {}


def register(name: str, factory: str | Callable[[], Task]) -> None:
    """Register a task factory (a callable or a ``module:attr`` path) under ``name``."""
    _FACTORIES[name] = factory
    _BUILT.pop(name, None)


def unregister(name: str) -> None:
    """Forget a task registered with :func:`register` (and the instance built from it)."""
    _FACTORIES.pop(name, None)
    _BUILT.pop(name, None)


def _plugins() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="sim2edge.tasks")}


def names() -> list[str]:
    return sorted({**_plugins(), **_FACTORIES})


def _resolve(path: str) -> Callable[[], Task]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def load(name: str) -> Task:
    """The task called ``name``, or ``module:Class`` for a user's own task; errors list valid names."""
    if name in _BUILT:
        return _BUILT[name]
    if name in _FACTORIES:
        factory = _FACTORIES[name]
    elif name in (plugins := _plugins()):
        factory = plugins[name]
    elif ":" in name:
        factory = name
    else:
        raise KeyError(f"unknown task {name!r}; valid tasks: {', '.join(names())} (or module:Class)")
    task = (_resolve(factory) if isinstance(factory, str) else factory)()
    task.validate()
    _BUILT[name] = task
    return task


def reference(name: str) -> tuple[str, str]:
    """``(module:Class, sha256 of its source file)`` of the task ``name``: what a registered version records so
    that evaluation, the nightly and tuning find a user's own task without an entry point, and can tell whether
    its code changed since."""
    cls = type(load(name))
    source = inspect.getsourcefile(cls)
    digest = hashlib.sha256(open(source, "rb").read()).hexdigest() if source else ""
    return f"{cls.__module__}:{cls.__qualname__}", digest
