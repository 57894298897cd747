"""Import external policies: an rsl_rl checkpoint (as Isaac Lab writes it) or an Isaac Lab ``policy.onnx``,
each with an I/O spec file, into the same exported artifact the pipeline's own export produces.

Both come out as ``policy.onnx`` mapping raw observations to actuator commands
(``default + scale * raw``, raw clipped first when the spec says so) with the observation
normalizer inside, checked against their source on ≥ 1,000 inputs, plus ``golden.npz``.
From there evaluation (``sim2edge evaluate --bundle``, when the spec names a registered task)
and packaging treat them like any other policy.

Checkpoint layouts read (keys of ``torch.load``):
- rsl_rl ≥ 4 (``OnPolicyRunner.save``): ``actor_state_dict`` with ``mlp.<i>.weight|bias`` and
  ``obs_normalizer._mean|_std`` when the actor normalizes.
- rsl_rl 2–3 (Isaac Lab's ``model_*.pt``): ``model_state_dict`` with ``actor.<i>.weight|bias``; the
  normalizer as ``actor_obs_normalizer._mean|_std`` inside it (3.x) or as ``obs_norm_state_dict`` (2.x).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from edge.bundle import sha256_path
from edge.runtime import OnnxRuntime
from stages.artifacts import ExportedPolicy, atomic_dir
from stages.export import ExportConfig, check_parity, export_module, parity_inputs
from stages.io_spec import IOSpec

NORMALIZER_EPS = 1e-2  # rsl_rl's EmpiricalNormalization: (x - mean) / (std + eps)
_ACTIVATIONS = {"elu": torch.nn.ELU, "relu": torch.nn.ReLU, "selu": torch.nn.SELU, "tanh": torch.nn.Tanh,
                "leaky_relu": torch.nn.LeakyReLU, "gelu": torch.nn.GELU, "silu": torch.nn.SiLU}


class PolicyImportError(ValueError):
    """The external policy does not fit the reader or its I/O spec (the message names file and field)."""


@dataclass(frozen=True)
class ActorWeights:
    """An MLP actor read from a checkpoint: Linear layers in order and the observation normalizer."""

    layout: str
    layers: tuple  # ((W (out, in), b (out,)), ...)
    mean: np.ndarray
    std: np.ndarray
    eps: float


def read_rsl_rl_checkpoint(path: Path) -> ActorWeights:
    """The actor of an rsl_rl checkpoint (either layout above); refuses recurrent or non-MLP actors by name."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a bad file
        raise PolicyImportError(f"{path}: not a readable torch checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(saved, dict):
        raise PolicyImportError(f"{path}: expected a dict checkpoint, got {type(saved).__name__}")
    if "actor_state_dict" in saved:
        layout, state, prefix, norm = "rsl_rl>=4", saved["actor_state_dict"], "mlp.", "obs_normalizer."
    elif "model_state_dict" in saved:
        layout, state, prefix, norm = "rsl_rl<4", saved["model_state_dict"], "actor.", "actor_obs_normalizer."
    else:
        raise PolicyImportError(f"{path}: no actor_state_dict or model_state_dict (keys: {', '.join(map(str, saved))})")
    if any(k.startswith(("memory", "rnn", "cnn")) for k in state):
        raise PolicyImportError(f"{path}: recurrent or convolutional actors are not supported (MLP actors only)")
    found = sorted({int(m.group(1)) for k in state for m in [re.match(re.escape(prefix) + r"(\d+)\.weight$", k)] if m})
    if not found:
        raise PolicyImportError(f"{path}: no {prefix}<i>.weight layers in the {layout} actor")
    layers = tuple((state[f"{prefix}{i}.weight"].detach().numpy().astype(np.float32),
                    state[f"{prefix}{i}.bias"].detach().numpy().astype(np.float32)) for i in found)
    for (w0, _), (w1, _) in zip(layers, layers[1:]):
        if w1.shape[1] != w0.shape[0]:
            raise PolicyImportError(f"{path}: layer widths do not chain ({w0.shape} then {w1.shape})")
    stats = ({k[len(norm):]: v for k, v in state.items() if k.startswith(norm)} or saved.get("obs_norm_state_dict") or {})
    n_obs = layers[0][0].shape[1]
    if stats:
        mean, std, eps = (stats["_mean"].reshape(-1).numpy().astype(np.float32),
                          stats["_std"].reshape(-1).numpy().astype(np.float32), NORMALIZER_EPS)
    else:
        mean, std, eps = np.zeros(n_obs, np.float32), np.ones(n_obs, np.float32), 0.0
    return ActorWeights(layout, layers, mean, std, eps)


class ImportedActor(torch.nn.Module):
    """Normalizer + MLP (the Gaussian mean: deterministic action) + clip + ``default + scale * raw``."""

    def __init__(self, weights: ActorWeights, spec: IOSpec) -> None:
        super().__init__()
        modules = []
        for i, (w, b) in enumerate(weights.layers):
            linear = torch.nn.Linear(w.shape[1], w.shape[0])
            linear.weight.data, linear.bias.data = torch.from_numpy(w), torch.from_numpy(b)
            modules += [linear] + ([_ACTIVATIONS[spec.activation]()] if i < len(weights.layers) - 1 else [])
        self.mlp = torch.nn.Sequential(*modules)
        self.register_buffer("mean", torch.from_numpy(weights.mean))
        self.register_buffer("denominator", torch.from_numpy(weights.std + weights.eps))
        self.register_buffer("scale", torch.from_numpy(spec.action_array("scale")))
        self.register_buffer("default", torch.from_numpy(spec.action_array("default")))
        self.clip = spec.raw_action_clip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        raw = self.mlp((obs - self.mean) / self.denominator)
        if self.clip is not None:
            raw = torch.clamp(raw, -self.clip, self.clip)
        return self.default + self.scale * raw


def _check_dims(source: Path, spec_path: Path, spec: IOSpec, n_obs: int, n_act: int) -> None:
    if n_obs != spec.obs_dim:
        raise PolicyImportError(f"{source} takes {n_obs} observations, {spec_path} lists {spec.obs_dim} (observations)")
    if n_act != spec.act_dim:
        raise PolicyImportError(f"{source} outputs {n_act} actions, {spec_path} lists {spec.act_dim} (actions)")


def _spec_stats(spec: IOSpec) -> tuple[np.ndarray, np.ndarray]:
    """Centre and spread for parity inputs from the spec's observation ranges (0 ± 1 where none is given)."""
    lo = np.array([o.low if o.low is not None else -1.0 for o in spec.observations], np.float32)
    hi = np.array([o.high if o.high is not None else 1.0 for o in spec.observations], np.float32)
    return (lo + hi) / 2, np.maximum((hi - lo) / 2, 1e-3)


def import_checkpoint(cfg: ExportConfig, checkpoint: Path, spec_path: Path, out_dir: Path) -> ExportedPolicy:
    """rsl_rl checkpoint + I/O spec → parity-checked ``policy.onnx`` and ``golden.npz`` in ``out_dir``."""
    spec = IOSpec.from_file(spec_path)
    weights = read_rsl_rl_checkpoint(checkpoint)
    _check_dims(checkpoint, spec_path, spec, weights.layers[0][0].shape[1], weights.layers[-1][0].shape[0])
    module = ImportedActor(weights, spec).eval()
    mean, std = (weights.mean, weights.std) if weights.eps else _spec_stats(spec)
    return export_module(cfg, module, mean, std, spec, out_dir)


def _with_action_mapping(model: onnx.ModelProto, spec: IOSpec) -> onnx.ModelProto:
    """Append ``[Clip] → Mul(scale) → Add(default)`` to the graph's output; output renamed ``action``."""
    graph = model.graph
    raw = "sim2edge_raw"  # the source's output, renamed (it may already be called "action")
    for node in graph.node:
        node.input[:] = [raw if n == graph.output[0].name else n for n in node.input]
        node.output[:] = [raw if n == graph.output[0].name else n for n in node.output]
    nodes, tensors, x = [], [], raw
    if spec.raw_action_clip is not None:
        tensors += [numpy_helper.from_array(np.array(-spec.raw_action_clip, np.float32), "sim2edge_clip_lo"),
                    numpy_helper.from_array(np.array(spec.raw_action_clip, np.float32), "sim2edge_clip_hi")]
        nodes.append(helper.make_node("Clip", [x, "sim2edge_clip_lo", "sim2edge_clip_hi"], ["sim2edge_clipped"]))
        x = "sim2edge_clipped"
    tensors += [numpy_helper.from_array(spec.action_array("scale"), "sim2edge_scale"),
                numpy_helper.from_array(spec.action_array("default"), "sim2edge_default")]
    nodes += [helper.make_node("Mul", [x, "sim2edge_scale"], ["sim2edge_scaled"]),
              helper.make_node("Add", ["sim2edge_scaled", "sim2edge_default"], ["action"])]
    graph.node.extend(nodes)
    graph.initializer.extend(tensors)
    out = helper.make_tensor_value_info("action", onnx.TensorProto.FLOAT, None)
    out.type.tensor_type.shape.CopyFrom(graph.output[0].type.tensor_type.shape)
    graph.output.pop()
    graph.output.append(out)
    return model


def _dynamic_batch(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy with dim 0 of input and output symbolic, if the graph then runs with batch 7; else None."""
    relaxed = onnx.ModelProto()
    relaxed.CopyFrom(model)
    for value in (relaxed.graph.input[0], relaxed.graph.output[0]):
        value.type.tensor_type.shape.dim[0].Clear()
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(relaxed.SerializeToString(), providers=["CPUExecutionProvider"])
        n_obs = relaxed.graph.input[0].type.tensor_type.shape.dim[1].dim_value
        session.run(None, {relaxed.graph.input[0].name: np.zeros((7, n_obs), np.float32)})
    except Exception:  # ORT's errors for a shape-bound graph vary; keep the fixed batch then
        return None
    return relaxed


def _run_rows(runtime: OnnxRuntime, x: np.ndarray, batch: int) -> np.ndarray:
    return np.concatenate([runtime.run(x[i:i + batch]) for i in range(0, len(x), batch)])


def import_onnx(cfg: ExportConfig, source: Path, spec_path: Path, out_dir: Path) -> ExportedPolicy:
    """Isaac Lab ``policy.onnx`` (normalizer inside, raw actions out) + I/O spec → the bundle's ``policy.onnx``."""
    spec = IOSpec.from_file(spec_path)
    try:
        model = onnx.load(str(source))
        onnx.checker.check_model(model)
    except Exception as e:  # onnx raises DecodeError, ValidationError, OSError …
        raise PolicyImportError(f"{source}: not a valid ONNX model ({type(e).__name__}: {e})") from None
    graph = model.graph
    if len(graph.input) != 1 or len(graph.output) != 1:
        raise PolicyImportError(f"{source}: needs one input and one output, has {len(graph.input)} and {len(graph.output)}")
    shapes = [[d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
              for v in (graph.input[0], graph.output[0])]
    if any(len(s) != 2 for s in shapes):
        raise PolicyImportError(f"{source}: input and output must be (batch, n); they are {shapes[0]} and {shapes[1]}")
    _check_dims(source, spec_path, spec, shapes[0][1], shapes[1][1])
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    mapped = _with_action_mapping(model, spec)
    mapped = _dynamic_batch(mapped) or mapped
    batch = mapped.graph.input[0].type.tensor_type.shape.dim[0].dim_value or 0
    mean, std = _spec_stats(spec)
    x = parity_inputs(mean, std, cfg.parity_samples, np.random.default_rng(cfg.seed))
    with atomic_dir(out_dir) as tmp:
        onnx.save(mapped, str(tmp / "policy.onnx"))
        onnx.checker.check_model(str(tmp / "policy.onnx"), full_check=True)
        raw = _run_rows(OnnxRuntime(source), x, shapes[0][0] if shapes[0][0] > 0 else len(x))
        if spec.raw_action_clip is not None:
            raw = np.clip(raw, -spec.raw_action_clip, spec.raw_action_clip)
        expected = spec.action_array("default") + spec.action_array("scale") * raw
        got = _run_rows(OnnxRuntime(tmp / "policy.onnx"), x, batch or len(x))
        err = check_parity(cfg, f"the source {source.name}", expected, got, x)
        np.savez(tmp / "golden.npz", inputs=x[: cfg.golden_samples], outputs=expected[: cfg.golden_samples])
    return ExportedPolicy(path=out_dir / "policy.onnx", digest=sha256_path(out_dir / "policy.onnx"), task=spec.task,
                          opset=opset, parity_max_abs_error=err, golden=out_dir / "golden.npz")
