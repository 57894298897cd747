"""Export: torch actor → ONNX with normalization and the deterministic action in the graph.

The exported graph maps raw observations (B, obs_dim) to actuator controls (B, act_dim):
``default + scale * clip(mlp(normalize(obs)), -1, 1)``. Parity against torch is checked
with ONNX Runtime through the device's own runtime code (``edge.runtime``).

The graph carries its I/O contract (:func:`annotate`): ``metadata_props`` (``sim2edge.io``, the JSON
of the manifest's ``io``/``control``/``policy``, and readable keys such as ``obs_names``, ``act_units``,
``control_period_s``) and doc strings on the graph, its input and its output, so Netron, Polygraphy and
ONNX Runtime's ``get_modelmeta()`` show term names, units, limits, default, scale and gear. Packaging
stamps the policy name and version (known only then) into the bundle's copy.

torch's exporter (``dynamo=True``) writes opset 18 and converts down to ``ExportConfig.opset``; the IR
version is then lowered to the oldest that opset allows (IR 8 for opset 17), because JetPack 5's
onnxruntime 1.16 reads IR ≤ 9 and the converter leaves IR 10.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from pydantic import BaseModel, ConfigDict, Field

from edge.bundle import sha256_path
from edge.runtime import OnnxRuntime
from stages.artifacts import Checkpoint, ExportedPolicy, atomic_dir
from stages.io_spec import IOSpec
from stages.sim.registry import load
from stages.train import load_actor

INPUT, OUTPUT = "obs", "action"


class ExportConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    opset: int = Field(17, ge=13, description="ONNX opset (17 parses on TensorRT 8.5 to 10.x); torch writes 18 and "
                                             "converts, the IR version is the lowest the opset allows.")
    parity_samples: int = Field(1000, ge=10, description="Random inputs in the parity check.")
    atol: float = Field(1e-5, gt=0)
    rtol: float = Field(1e-4, ge=0)
    golden_samples: int = Field(64, ge=1, description="Inputs recorded with reference outputs for the device.")
    seed: int = 0


class PrivilegedInput(ValueError):
    """The actor to export reads a simulator-only (privileged) term that no robot can provide."""


def check_actor_inputs(spec: IOSpec, n_inputs: int, task_ref: str | None) -> None:
    """Refuse an actor whose inputs are not exactly the task's non-privileged observation terms."""
    try:
        privileged = {t.name for t in load(task_ref or spec.task).privileged}
    except KeyError:  # an imported policy's own task, not registered here: no privileged terms known
        privileged = set()
    read = [o.name for o in spec.observations if o.name in privileged]
    if read:
        raise PrivilegedInput(f"export: the actor reads privileged (simulator-only) term(s) {read} of task "
                              f"{task_ref or spec.task!r}; only the critic may see them")
    if n_inputs != spec.obs_dim:
        raise PrivilegedInput(f"export: the actor takes {n_inputs} inputs but task {task_ref or spec.task!r} has "
                              f"{spec.obs_dim} observation terms (a critic-only term among its inputs?)")


class ParityError(RuntimeError):
    """ONNX Runtime disagrees with torch beyond tolerance."""


class DeployedActor(torch.nn.Module):
    """Normalizer + MLP + deterministic action, then clipping and scaling to actuator units."""

    def __init__(self, inner: torch.nn.Module, scale: np.ndarray, default: np.ndarray) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))
        self.register_buffer("default", torch.as_tensor(default, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.default + self.scale * torch.clamp(self.inner(obs), -1.0, 1.0)


def parity_inputs(mean: np.ndarray, std: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """In-distribution samples, far out-of-distribution samples (±10σ), zeros and extremes."""
    k = n // 2
    inside = mean + std * rng.standard_normal((k, len(mean)))
    outside = mean + 10 * std * rng.uniform(-1, 1, (n - k - 3, len(mean)))
    edges = np.stack([np.zeros_like(mean), mean + 1e3 * std, mean - 1e3 * std])
    return np.concatenate([inside, outside, edges]).astype(np.float32)


GOLDEN_SPREADS = tuple(2.0 ** -k for k in range(11))
"""Golden candidates: ``mean + spread·std·N(0, 1)`` at each spread, 1 down to 1/1024."""


def golden_inputs(module: torch.nn.Module, spec: IOSpec, mean: np.ndarray, std: np.ndarray, n: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """``n`` golden inputs, their outputs and the fraction of those outputs inside the action clip.

    A saturated output compares a constant, so of ``n`` candidates per spread (widest first) the ``n`` with the
    most unsaturated components are kept, the wider spread first among equals: a smooth policy keeps its
    in-distribution samples, a bang-bang one gets samples near the mean where it is not yet at the clip."""
    x = np.concatenate([mean + s * std * rng.standard_normal((n, len(mean))) for s in GOLDEN_SPREADS]).astype(np.float32)
    with torch.no_grad():
        y = module(torch.from_numpy(x)).numpy()
    free = spec.unsaturated(y).sum(axis=1)
    best = np.sort(np.argsort(-free, kind="stable")[:n])
    return x[best], y[best], float(spec.unsaturated(y[best]).mean())


def export(cfg: ExportConfig, checkpoint: Checkpoint, out_dir: Path) -> ExportedPolicy:
    """Write ``policy.onnx`` and ``golden.npz`` into ``out_dir``; raise ParityError on mismatch."""
    task = load(checkpoint.task)
    actor = load_actor(checkpoint.path)
    module = DeployedActor(actor.as_onnx(verbose=False), task.action_scale, task.action_default).eval()
    normalizer = actor.obs_normalizer
    spec = IOSpec.from_task(task)
    return export_module(cfg, module, normalizer.mean.numpy(), normalizer.std.numpy(), spec, out_dir,
                         task_ref=checkpoint.task)


def torch_to_onnx(module: torch.nn.Module, obs_dim: int, opset: int) -> onnx.ModelProto:
    """``module`` as an ONNX model at ``opset`` with a dynamic batch, IR version as low as the opset allows."""
    batch = torch.export.Dim("batch", min=1, max=65536)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (torch.zeros(2, obs_dim),), None, opset_version=opset,
                                    input_names=[INPUT], output_names=[OUTPUT], dynamic_shapes=({0: batch},),
                                    dynamo=True, external_data=False, verbose=False)
    model = program.model_proto
    if model.functions:
        raise ValueError(f"the exported graph has local functions ({model.functions[0].name}); IR lowering "
                         "keeps only plain graphs")
    model.ir_version = onnx.helper.find_min_ir_version_for(list(model.opset_import))
    return model


def export_module(cfg: ExportConfig, module: torch.nn.Module, mean: np.ndarray, std: np.ndarray, spec: IOSpec,
                  out_dir: Path, task_ref: str | None = None) -> ExportedPolicy:
    """Export ``module`` ((B, obs) → (B, act) in actuator units, as ``spec`` describes) with its contract in the
    metadata, and check it against torch on parity inputs drawn around the observation statistics ``mean``/``std``.
    ``task_ref``: the task reference recorded on the artifact (default ``spec.task``)."""
    check_actor_inputs(spec, len(mean), task_ref)
    rng = np.random.default_rng(cfg.seed)
    with atomic_dir(out_dir) as tmp:
        onnx_path = tmp / "policy.onnx"
        model = torch_to_onnx(module, len(mean), cfg.opset)
        annotate(model, spec.manifest_io(INPUT, OUTPUT), spec.manifest_control(), {"task": spec.task})
        onnx.checker.check_model(model, full_check=True)
        onnx.save(model, str(onnx_path))
        x = parity_inputs(mean, std, cfg.parity_samples, rng)
        with torch.no_grad():
            expected = module(torch.from_numpy(x)).numpy()
        err = check_parity(cfg, "torch", expected, OnnxRuntime(onnx_path).run(x), x)
        gx, gy, unsaturated = golden_inputs(module, spec, mean, std, cfg.golden_samples, rng)
        check_parity(cfg, "torch (golden inputs)", gy, OnnxRuntime(onnx_path).run(gx), gx)
        np.savez(tmp / "golden.npz", inputs=gx, outputs=gy)
    return ExportedPolicy(path=out_dir / "policy.onnx", digest=sha256_path(out_dir / "policy.onnx"),
                          task=task_ref or spec.task, opset=cfg.opset, parity_max_abs_error=err,
                          golden=out_dir / "golden.npz", golden_unsaturated_fraction=unsaturated)


def _terms(terms: list[dict]) -> str:
    """``name [unit]`` per term (``name [unit] − offset`` where the term is relative)."""
    return ", ".join(f"{t['name']} [{t['unit']}]" + (f" − {t['offset']:g}" if t.get("offset") else "") for t in terms)


def annotate(model: onnx.ModelProto, io: dict, control: dict, policy: dict) -> onnx.ModelProto:
    """Write the I/O contract into ``model`` in place: ``metadata_props`` and doc strings of graph, input, output.

    ``io``/``control``/``policy``: the manifest's sections (:meth:`IOSpec.manifest_io`, ``manifest_control``,
    ``{"name", "version", "task"}`` — name and version once packaging knows them). Keys are written sorted,
    values as JSON where they are lists, so the same contract gives the same bytes."""
    inp, out = io["input"], io["output"]
    props = {
        "sim2edge.io": json.dumps({"io": io, "control": control, "policy": policy}, sort_keys=True,
                                  separators=(",", ":")),
        "control_period_s": repr(float(control["period_s"])),
        "obs_names": json.dumps([t["name"] for t in inp["terms"]]),
        "obs_units": json.dumps([t["unit"] for t in inp["terms"]]),
        "act_names": json.dumps([t["name"] for t in out["terms"]]),
        "act_units": json.dumps([t["unit"] for t in out["terms"]]),
        **{f"act_{k}": json.dumps(out[k]) for k in ("low", "high", "default", "scale", "gear") if k in out},
        **{key: str(policy[k]) for key, k in (("policy", "name"), ("version", "version"), ("task", "task"))
           if policy.get(k) is not None},
    }
    if any("offset" in t for t in inp["terms"]):
        props["obs_offsets"] = json.dumps([t.get("offset", 0.0) for t in inp["terms"]])
    keep = [p for p in model.metadata_props if p.key not in props]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for key in sorted(props):
        model.metadata_props.add(key=key, value=props[key])
    if str(policy.get("version", "")).isdigit():
        model.model_version = int(policy["version"])  # ONNX's own field (Netron: "version")
    who = (f"{policy['name']} v{policy['version']}" if policy.get("name") and policy.get("version")
           else "(name and version are stamped at packaging)")
    clip = out.get("raw_action_clip")
    model.doc_string = (f"sim2edge policy {who}, task {policy.get('task')}: observations → actuator commands every "
                        f"{float(control['period_s']):g} s; the contract is metadata_props['sim2edge.io']")
    model.graph.input[0].doc_string = f"observations, in this order: {_terms(inp['terms'])}"
    model.graph.output[0].doc_string = (
        f"actuator commands, in this order: {_terms(out['terms'])}; "
        f"output = default + scale · {f'clip(raw, ±{clip:g})' if clip else 'raw'}, physical command = gear · output; "
        + "; ".join(f"{k} {out[k]}" for k in ("low", "high", "default", "scale", "gear") if k in out))
    model.graph.doc_string = "\n".join([model.doc_string, f"input {inp['name']}: {model.graph.input[0].doc_string}",
                                        f"output {out['name']}: {model.graph.output[0].doc_string}"])
    return model


def check_parity(cfg: ExportConfig, reference: str, expected: np.ndarray, got: np.ndarray, x: np.ndarray) -> float:
    """Max |got - expected| elementwise within atol + rtol·|expected|; else ParityError with the worst input."""
    err = np.abs(got - expected)
    if not np.all(err <= cfg.atol + cfg.rtol * np.abs(expected)):
        worst = int(np.argmax(err.max(axis=1)))
        raise ParityError(f"ONNX Runtime vs {reference}: max error {err.max():.3g} > tolerance "
                          f"(atol {cfg.atol}, rtol {cfg.rtol}) at input {x[worst].tolist()}")
    return float(err.max())


def build_engines(exported: ExportedPolicy, cache_dir: Path, precisions: tuple[str, ...] = ("fp16",),
                  dla_core: int | None = None) -> list[Path]:
    """On a GPU build host that matches the target: TensorRT plans for ``exported`` (the device's own code,
    :mod:`edge.tensorrt`), cached under ``cache_dir`` by (TensorRT, compute capability, precision, ONNX digest).
    Pass the returned paths to ``package(..., engines=…)``; a device uses a plan only on an exact key match."""
    from edge.tensorrt import EngineCache

    cache = EngineCache(cache_dir)
    return [cache.path(cache.get_or_build(exported.path, exported.digest, p, dla_core if p == "fp16" else None)[0])
            for p in precisions]
