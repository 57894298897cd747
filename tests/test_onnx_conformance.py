"""The exported ONNX against the stock tools: onnx.checker, onnx.load's metadata, onnxruntime's model metadata,
``polygraphy inspect model``; opset and IR version against the oldest target (JetPack 5: TensorRT 8.5,
onnxruntime 1.16.3, run for real under Python 3.8); golden inputs that mostly leave the action clip alone;
units written as units."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mujoco
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edge import bundle, signing
from edge.targets import PROFILES, load_target
from edge.tensorrt import EngineKey
from stages.export import (DeployedActor, ExportConfig, INPUT, OUTPUT, export, export_module, parity_inputs,
                           torch_to_onnx)
from stages.import_policy import _ACTIVATIONS
from stages.io_spec import IOSpec
from stages.onnx_support import ONNXRUNTIMES, UnsupportedOnnx, check_onnx_support
from stages.package import PackageConfig, build_manifest, package
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.train import train
from stages.train_config import TrainConfig
from tests.test_edge_pythons import REPO, interpreter

CARTPOLE = IOSpec.from_task(load("cartpole"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    ckpt = train(TrainConfig(iterations=2, num_envs=8, steps_per_env=8, hidden_dims=(16, 16)), PhysicalParams(),
                 tmp / "checkpoint")
    return export(ExportConfig(parity_samples=200), ckpt, tmp / "onnx")


def props(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def test_onnx_checker_and_metadata_props_carry_the_contract(exported):
    model = onnx.load(str(exported.path))
    onnx.checker.check_model(model, full_check=True)
    meta = props(model)
    contract = json.loads(meta["sim2edge.io"])
    assert contract["io"] == json.loads(json.dumps(CARTPOLE.manifest_io(INPUT, OUTPUT)))
    assert contract["control"]["period_s"] == float(meta["control_period_s"]) == pytest.approx(0.02)
    assert json.loads(meta["obs_names"]) == ["cart_pos", "pole_cos", "pole_sin", "cart_vel", "pole_angvel"]
    assert json.loads(meta["obs_units"]) == ["m", "1", "1", "m/s", "rad/s"]
    assert (json.loads(meta["act_names"]), json.loads(meta["act_units"])) == (["slide"], ["N"])
    assert [json.loads(meta[f"act_{k}"]) for k in ("low", "high", "default", "scale", "gear")] == \
        [[-1.0], [1.0], [0.0], [1.0], [10.0]]
    assert meta["task"] == "cartpole" and "version" not in meta  # the version is stamped at packaging
    assert "pole_angvel [rad/s]" in model.graph.input[0].doc_string
    assert "slide [N]" in model.graph.output[0].doc_string and "gear [10.0]" in model.graph.output[0].doc_string
    # onnxruntime reads the same keys (what a C++ or Python device program sees)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map == meta
    assert "0.02 s" in session.get_modelmeta().description


def test_polygraphy_inspect_shows_terms_and_units(exported):
    polygraphy = shutil.which("polygraphy", path=str(Path(sys.executable).parent))
    out = subprocess.run([polygraphy, "inspect", "model", str(exported.path), "--show", "layers", "attrs"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    doc = text[text.index("---- Docstring ----"):text.index("Graph Input(s)")]
    assert "ONNX Opset: 17" in text
    for term in ("cart_pos [m]", "cart_vel [m/s]", "pole_angvel [rad/s]", "slide [N]", "gear [10.0]", "0.02 s"):
        assert term in doc, (term, doc)


def test_export_is_deterministic_with_metadata(saturating, tmp_path):
    again = export_module(ExportConfig(parity_samples=200), _saturating_actor(), *_stats(), CARTPOLE, tmp_path / "b")
    assert again.path.read_bytes() == saturating.path.read_bytes() and again.digest == saturating.digest
    assert again.golden.read_bytes() == saturating.golden.read_bytes()


# -- opset and IR version -----------------------------------------------------------------------------------------

def test_opset_17_and_the_lowest_ir_version(exported):
    model = onnx.load(str(exported.path))
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.ir_version == onnx.helper.find_min_ir_version_for(model.opset_import) == 8
    assert model.ir_version <= min(r.max_ir_version for r in ONNXRUNTIMES.values())
    for target in PROFILES.values():
        check_onnx_support(exported.path, target)


def test_ir_version_newer_than_the_targets_onnxruntime_is_refused(exported, tmp_path):
    model = onnx.load(str(exported.path))
    model.ir_version = 10  # what torch's exporter leaves after converting opset 18 → 17
    path = tmp_path / "ir10.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UnsupportedOnnx, match=r"IR version 10 is newer than onnxruntime 1\.16\.3 \(JetPack 5\.1\)"):
        check_onnx_support(path, load_target("orin-jp5.1"))
    check_onnx_support(path, load_target("orin-jp6.1"))  # onnxruntime 1.20 reads IR 10


class _Policy(torch.nn.Module):
    """Normalizer + MLP with one activation: the operators a trained or imported policy's graph holds."""

    def __init__(self, activation: torch.nn.Module, mean: np.ndarray, std: np.ndarray, gain: float = 0.5) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.register_buffer("mean", torch.from_numpy(mean))
        self.register_buffer("std", torch.from_numpy(std))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(5, 32), activation, torch.nn.Linear(32, 32), activation,
                                       torch.nn.Linear(32, 1))
        for p in self.mlp.parameters():
            p.data = torch.randn(p.shape, generator=gen) * gain

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.mlp((obs - self.mean) / self.std)


@pytest.mark.parametrize("activation", sorted(_ACTIVATIONS))
def test_opset_conversion_keeps_every_policy_operator_exact(activation, tmp_path):
    """torch writes opset 18 and converts to 17: per activation (normalizer, Gemm, activation, clip, scale, default),
    the opset-17 graph matches torch on in- and out-of-distribution inputs and parses on JetPack 5's TensorRT 8.5."""
    mean, std = np.array([0.1, -0.2, 0.3, 0.0, 1.0], np.float32), np.array([0.5, 1.0, 2.0, 0.3, 1.5], np.float32)
    module = DeployedActor(_Policy(_ACTIVATIONS[activation](), mean, std, gain=0.15), np.array([2.0], np.float32),
                           np.array([0.5], np.float32)).eval()
    x = parity_inputs(mean, std, 1000, np.random.default_rng(1))
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    model = torch_to_onnx(module, 5, 17)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17 and model.ir_version == 8
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {INPUT: x})[0]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)
    assert 0.3 < np.mean(np.abs(expected - 0.5) < 2.0 * (1 - 1e-6)) < 0.9, "both clipped and linear outputs compared"
    onnx.save(model, str(tmp_path / "p.onnx"))
    check_onnx_support(tmp_path / "p.onnx", load_target("orin-jp5.1"))


@pytest.mark.device
def test_jetpack5_onnxruntime_runs_the_export_and_refuses_ir_10(exported, tmp_path):
    """onnxruntime 1.16.3 (JetPack 5's, in a Python 3.8 venv) loads the export and reproduces its golden outputs;
    the same graph at IR 10 (the converter's) does not load there."""
    python = ort116_venv()
    model = onnx.load(str(exported.path))
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "ir10.onnx"))
    script = """
import sys, numpy as np, onnxruntime as ort
g = np.load(sys.argv[2])
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print("version", ort.__version__, "max_error", float(np.abs(s.run(None, {"obs": g["inputs"]})[0] - g["outputs"]).max()))
print("units", s.get_modelmeta().custom_metadata_map["act_units"])
try:
    ort.InferenceSession(sys.argv[3], providers=["CPUExecutionProvider"])
    print("ir10 loaded")
except Exception as e:
    print("ir10 refused:", str(e).splitlines()[-1][-80:])
"""
    out = subprocess.run([str(python), "-c", script, str(exported.path), str(exported.golden), str(tmp_path / "ir10.onnx")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["version"].startswith("1.16.3") and float(lines["version"].split()[-1]) <= 1e-5, out.stdout
    assert lines["units"] == '["N"]'
    assert "Unsupported model IR version: 10, max supported IR version: 9" in lines["ir10"], out.stdout


def ort116_venv() -> Path:
    """A Python 3.8 venv with onnxruntime 1.16.3 (jetson-containers' default on L4T 35); reused across runs."""
    python = interpreter("3.8")
    if python is None:
        pytest.skip("CPython 3.8 (JetPack 5) is not installed here")
    venv = REPO / ".venv-edge" / "ort-1.16.3"
    stamp = venv / ".installed"
    if not stamp.exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "onnxruntime==1.16.3", "numpy<1.25"],
                             capture_output=True, text=True)
        if pip.returncode != 0:
            pytest.skip(f"cannot install onnxruntime 1.16.3 here: {pip.stderr.strip().splitlines()[-1:]}")
        stamp.touch()
    return venv / "bin" / "python"


# -- golden inputs --------------------------------------------------------------------------------------------------

def _stats() -> tuple[np.ndarray, np.ndarray]:
    return np.array([0.0, 1.0, 0.0, 0.0, 0.0], np.float32), np.array([0.5, 0.05, 0.3, 1.0, 2.0], np.float32)


def _saturating_actor() -> DeployedActor:
    """A bang-bang-like policy: |raw| > 1 for most observations within one σ of the mean, linear near it."""
    mean, std = _stats()
    inner = _Policy(torch.nn.Tanh(), mean, std)
    with torch.no_grad():
        inner.mlp[-1].weight.mul_(4.0)
        inner.mlp[-1].bias.zero_()
        inner.mlp[0].bias.zero_()
        inner.mlp[2].bias.zero_()
    return DeployedActor(inner, CARTPOLE.action_array("scale"), CARTPOLE.action_array("default")).eval()


@pytest.fixture(scope="module")
def saturating(tmp_path_factory):
    mean, std = _stats()
    return export_module(ExportConfig(parity_samples=200), _saturating_actor(), mean, std, CARTPOLE,
                         tmp_path_factory.mktemp("saturating") / "onnx")


def test_golden_inputs_leave_most_outputs_unsaturated(saturating):
    module = _saturating_actor()
    mean, std = _stats()
    x = (mean + std * np.random.default_rng(0).standard_normal((64, 5))).astype(np.float32)
    with torch.no_grad():
        naive = CARTPOLE.unsaturated(module(torch.from_numpy(x)).numpy()).mean()
    assert naive < 0.5, f"the test policy should saturate around the statistics ({naive:.2f} unsaturated)"
    golden = np.load(saturating.golden)
    fraction = float(CARTPOLE.unsaturated(golden["outputs"]).mean())
    assert fraction >= 0.75 and saturating.golden_unsaturated_fraction == fraction
    assert len(golden["inputs"]) == 64 and len(np.unique(golden["inputs"], axis=0)) == 64
    np.testing.assert_allclose(ort.InferenceSession(str(saturating.path)).run(None, {INPUT: golden["inputs"]})[0],
                               golden["outputs"], atol=1e-5)


def test_trained_policys_golden_fraction_reaches_the_manifest(exported, tmp_path):
    golden = np.load(exported.golden)
    assert exported.golden_unsaturated_fraction == CARTPOLE.unsaturated(golden["outputs"]).mean() >= 0.75
    manifest = build_manifest(PackageConfig(), "cartpole", "3", exported, CARTPOLE, {}, None)
    assert manifest["golden"] == {"samples": 64, "unsaturated_fraction": exported.golden_unsaturated_fraction}


# -- the bundle's copy: name and version stamped ---------------------------------------------------------------------

def test_bundle_onnx_carries_name_and_version_and_plans_follow_its_digest(exported, tmp_path):
    keys = tmp_path / "keys"
    signing.generate_keypair(keys / "signing.key", keys / "signing.pub")
    plan = tmp_path / EngineKey("10.3", "8.7", "fp16", exported.digest).filename
    plan.write_bytes(b"a plan built from the exported graph")
    cfg = PackageConfig(target="orin-jp6.1")
    manifest = build_manifest(cfg, "balance", "7", exported, CARTPOLE, {}, None)
    art = package(cfg, manifest, exported, keys, tmp_path / "b.tar", engines=[plan])
    x = tmp_path / "x"
    bundle.extract(art.path, x, 1 << 26)
    verified = bundle.verify_dir(x, signing.load_trusted([keys / "signing.pub"]))
    released, source = onnx.load(str(x / "policy.onnx")), onnx.load(str(exported.path))
    meta = props(released)
    assert (meta["policy"], meta["version"], released.model_version) == ("balance", "7", 7)
    assert json.loads(meta["sim2edge.io"]) == {"io": manifest["io"], "control": manifest["control"],
                                               "policy": manifest["policy"]}
    assert "balance v7" in released.doc_string
    assert released.graph.node == source.graph.node and released.graph.initializer == source.graph.initializer
    digest = verified["files"]["policy.onnx"]["sha256"]
    assert verified["provenance"]["onnx_sha256"] == exported.digest != digest
    # the device looks a prebuilt plan up by the bundled ONNX's digest (edge.runtime)
    assert f"engines/{EngineKey('10.3', '8.7', 'fp16', digest).filename}" in verified["files"]
    foreign = tmp_path / EngineKey("10.3", "8.7", "fp16", "0" * 64).filename
    foreign.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"engine .*: not built from policy\.onnx"):
        package(cfg, manifest, exported, keys, tmp_path / "c.tar", engines=[foreign])


# -- units ------------------------------------------------------------------------------------------------------------

SI = re.compile(r"^(1|(m|s|rad|N|kg)( (m|s|rad|N|kg))*(/(m|s|rad|N|kg)(\^\d)?)?)$")
"""The units the tasks use: SI symbols, products with a space (``N m``), one quotient (``m/s``); ``1``."""


@pytest.mark.parametrize("name", ["cartpole", "reacher", "quadruped", "arm6"])
def test_units_are_units_and_scales_are_numbers(name):
    spec = IOSpec.from_task(load(name))
    for term in (*spec.observations, *spec.actions):
        assert SI.match(term.unit), f"{name}: {term.name} has unit {term.unit!r}"


@pytest.mark.parametrize("unit", ["N/10", "200 Nm", "0.5 rad setpoint", "rad from standing"])
def test_a_spec_with_a_factor_in_its_unit_is_refused_in_one_line(unit, tmp_path):
    spec = {"observations": [{"name": "x", "unit": "m"}], "control_period_s": 0.02,
            "actions": [{"name": "slide", "unit": unit, "low": -1, "high": 1}]}
    (tmp_path / "io.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError) as e:
        IOSpec.from_file(tmp_path / "io.json")
    assert str(e.value).startswith(f"{tmp_path / 'io.json'}: actions.0.unit: Value error, unit {unit!r} is not a unit")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,joint,gear,unit", [("cartpole", "slider", 10.0, "N"), ("reacher", "joint0", 200.0, "N m")])
def test_motor_gear_is_the_force_per_output_in_mujoco(name, joint, gear, unit):
    """MuJoCo applies gear × output: 0.5 on the output is 0.5·gear N (or N m) on the joint."""
    task = load(name)
    spec = IOSpec.from_task(task)
    assert (spec.actions[0].unit, spec.actions[0].gear) == (unit, gear)
    data = mujoco.MjData(task.model)
    data.ctrl[:] = 0.0
    data.ctrl[0] = 0.5
    mujoco.mj_forward(task.model, data)
    dof = task.model.jnt_dofadr[mujoco.mj_name2id(task.model, mujoco.mjtObj.mjOBJ_JOINT, joint)]
    assert data.qfrc_actuator[dof] == pytest.approx(0.5 * spec.actions[0].gear)


def test_quadruped_joint_angles_are_observed_from_the_standing_offset():
    task = load("quadruped")
    spec = IOSpec.from_task(task)
    qpos = np.tile(task.reference_qpos, (1, 1))
    qpos[0, task.joint_qpos] += 0.1
    qvel = np.zeros((1, task.model.nv))
    command = np.zeros((1, len(task.commands)), np.float32)
    obs = task.observe(qpos, qvel, np.zeros((1, task.act_dim), np.float32), **task.command_args(command),
                       **task.sensor_args(task.sensordata_at(qpos, qvel)))[0]
    for i, term in enumerate(spec.observations):
        if term.name.endswith("_pos"):
            measured = qpos[0, task.joint_qpos[[a.name for a in spec.actions].index(term.name[:-4])]]
            assert obs[i] == pytest.approx(measured - (term.offset or 0.0), abs=1e-6), term.name
            assert term.unit == "rad"
