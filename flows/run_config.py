"""A run configuration: the pipeline's parameters as one YAML file, layered over the task's preset.

Precedence, lowest first: the parameters' defaults, the task's preset (``stages/sim/presets/<task>.yaml`` or the
task's own ``preset``), the ``--config`` file, each ``--set key.path=value``, then options given on the command line.
The result is validated as :class:`flows.params.SimToEdgeParams`, the same model the Prefect deployment's form uses,
so one file drives a CLI run and a deployment run. A mistake is one line naming the file, the key and what it allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, get_args

import yaml
from pydantic import BaseModel, ValidationError

from edge.targets import load_target
from flows.params import SimToEdgeParams


class RunConfigError(ValueError):
    """A run configuration that cannot be used; the message names the file or option and the key."""


def read_yaml(path: Path) -> dict:
    """The mapping in ``path``, or a :class:`RunConfigError` naming the file."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise RunConfigError(f"{path}: cannot read it as YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RunConfigError(f"{path}: a run configuration is a mapping of keys, got {type(data).__name__}")
    return data


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict:
    """``base`` updated by ``over``, nested mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def assignment(text: str) -> dict:
    """``train.learning_rate=3e-4`` → ``{"train": {"learning_rate": 0.0003}}`` (the value read as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RunConfigError(f"--set {text!r}: write KEY=VALUE, e.g. train.learning_rate=3e-4")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def allowed_keys(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The field names at ``loc``'s parent inside ``model`` (for 'extra key' messages)."""
    for part in loc[:-1]:
        annotation = model.model_fields[str(part)].annotation if str(part) in model.model_fields else None
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)  # Optional[Model]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def explain(e: ValidationError, source: str) -> RunConfigError:
    """The first validation error as one line: where, which key, what is wrong, what is allowed."""
    err = e.errors()[0]
    key = ".".join(map(str, err["loc"]))
    if err["type"] == "extra_forbidden":
        return RunConfigError(f"{source}: {key}: not a key here; allowed: "
                              f"{', '.join(allowed_keys(SimToEdgeParams, err['loc']))}")
    if not err["loc"]:  # a check across keys (a model validator) names its keys itself
        return RunConfigError(f"{source}: {err['msg'].removeprefix('Value error, ')}")
    return RunConfigError(f"{source}: {key}: {err['msg']} (got {err.get('input')!r})")


def target_problems(layers: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """The target named by the last layer that sets one, as an error if it is unknown (none if it is fine)."""
    target = next((layer["target"] for _, layer in reversed(layers) if "target" in layer), None)
    try:
        if target is not None:
            load_target(str(target))
    except KeyError as e:
        return [f"target: {str(e).strip(chr(34))}"]
    return []


def over_task_ranges(data: dict, task_ranges: Mapping[str, Any]) -> dict:
    """``data`` with its ``train.randomization`` mapping completed by the task's own ranges, so that setting
    ``latency_steps`` alone keeps the task's damping, gain and mass ranges (and the resolved file says them all)."""
    train = data.get("train")
    if not isinstance(train, Mapping) or not isinstance(train.get("randomization"), Mapping):
        return data
    return merge(data, {"train": {"randomization": merge(task_ranges, train["randomization"])}})


def resolve(task: Optional[str], config: Optional[Path], sets: Sequence[str], options: Mapping[str, Any]) -> SimToEdgeParams:
    """The validated parameters of a run (see the module docstring for the order of layers)."""
    from stages.sim.registry import load

    layers = [("--config " + str(config), read_yaml(config))] if config else []
    layers += [(f"--set {s}", assignment(s)) for s in sets]
    layers.append(("the command line", {k: v for k, v in options.items() if v is not None}))
    chosen = task or next((layer["task"] for _, layer in reversed(layers) if "task" in layer), "cartpole")
    try:
        task_object = load(chosen)
        preset = task_object.preset_path
    except (KeyError, ImportError, AttributeError, ValueError) as e:
        raise RunConfigError("; ".join([f"task: {str(e).strip(chr(34))}"] + target_problems(layers))) from None
    data: dict = {}
    for name, layer in ([(str(preset), read_yaml(preset))] if preset else []) + layers:
        data = over_task_ranges(merge(data, layer), task_object.randomization.model_dump())
        try:
            SimToEdgeParams.model_validate({**data, "task": chosen})  # cross-key checks see the run's task
        except ValidationError as e:
            raise explain(e, name) from None
    return SimToEdgeParams.model_validate({**data, "task": chosen})
