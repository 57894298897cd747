"""Import of external policies: a checkpoint written by rsl-rl-lib's own OnPolicyRunner.save(), an ONNX exported
the way Isaac Lab exports (rsl_rl's as_onnx module, input ``obs``, output ``actions``, batch fixed at 1), each
with an I/O spec file; then packaging and the device's smoke test."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from edge import bundle, signing
from edge.runtime import OnnxRuntime
from edge.smoke import smoke_test
from stages.export import ExportConfig, ParityError
from stages.import_policy import PolicyImportError, import_checkpoint, import_onnx, read_rsl_rl_checkpoint
from stages.io_spec import IOSpec
from stages.onnx_support import UnsupportedOnnx
from stages.package import PackageConfig, build_manifest, package

SPEC_YAML = """\
task: cartpole
observations:
  - {name: cart_pos, unit: m, low: -2.4, high: 2.4}
  - {name: pole_cos, unit: "1", low: -1, high: 1}
  - {name: pole_sin, unit: "1", low: -1, high: 1}
  - {name: cart_vel, unit: m/s, low: -5, high: 5}
  - {name: pole_angvel, unit: rad/s, low: -10, high: 10}
actions:
  - {name: slide, unit: N, low: -1.0, high: 1.0, default: 0.1, scale: 0.5, gear: 10}
control_period_s: 0.02
raw_action_clip: 1.5
activation: elu
"""


@pytest.fixture(scope="module")
def runner_checkpoint(tmp_path_factory):
    """One PPO iteration of rsl-rl-lib's OnPolicyRunner on 4 cart-poles, saved by runner.save()."""
    from rsl_rl.runners import OnPolicyRunner

    from stages.sim.env import BatchedEnv
    from stages.sim.registry import load
    from stages.rsl_env import RslRlEnv, rsl_rl_config
    from stages.train_config import TrainConfig

    torch.manual_seed(0)
    cfg = TrainConfig(iterations=1, num_envs=4, steps_per_env=8, hidden_dims=(16, 16))
    runner = OnPolicyRunner(RslRlEnv(BatchedEnv(load("cartpole"), cfg.num_envs)),
                            {**rsl_rl_config(cfg), "save_interval": 50, "logger": "tensorboard"}, log_dir=None)
    runner.learn(1)
    path = tmp_path_factory.mktemp("rsl") / "model_1.pt"
    runner.save(str(path))
    return path, runner


@pytest.fixture()
def spec(tmp_path):
    path = tmp_path / "io.yaml"
    path.write_text(SPEC_YAML)
    return path


def test_runner_checkpoint_imports_with_normalizer_and_action_mapping(runner_checkpoint, spec, tmp_path):
    path, runner = runner_checkpoint
    weights = read_rsl_rl_checkpoint(path)
    assert weights.layout == "rsl_rl>=4" and [w.shape for w, _ in weights.layers] == [(16, 5), (16, 16), (1, 16)]
    assert not np.allclose(weights.mean, 0), "one iteration of rollouts moves the normalizer"
    exported = import_checkpoint(ExportConfig(), path, spec, tmp_path / "onnx")
    assert exported.parity_max_abs_error < 1e-5
    # the reference is rsl_rl's own inference policy (normalizer + deterministic action), mapped per the spec
    x = np.random.default_rng(1).normal(size=(64, 5)).astype(np.float32) * 3
    expected = 0.1 + 0.5 * np.clip(rsl_rl_actions(runner, x), -1.5, 1.5)
    np.testing.assert_allclose(OnnxRuntime(exported.path).run(x), expected, atol=1e-5)


def rsl_rl_actions(runner, x: np.ndarray) -> np.ndarray:
    from tensordict import TensorDict

    with torch.no_grad():
        return runner.get_inference_policy()(TensorDict({"policy": torch.from_numpy(x)}, batch_size=[len(x)])).numpy()


def test_isaac_lab_onnx_imports_packages_and_smokes(runner_checkpoint, spec, tmp_path):
    _, runner = runner_checkpoint
    runner.export_policy_to_onnx(str(tmp_path))  # rsl_rl's exporter: obs → actions, batch 1, opset 18
    source = tmp_path / "policy.onnx"
    assert onnx.load(str(source)).graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1
    exported = import_onnx(ExportConfig(), source, spec, tmp_path / "onnx")
    model = onnx.load(str(exported.path))
    assert [o.name for o in model.graph.output] == ["action"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch", "batch made dynamic"
    x = np.random.default_rng(2).normal(size=(9, 5)).astype(np.float32)
    expected = 0.1 + 0.5 * np.clip(rsl_rl_actions(runner, x), -1.5, 1.5)
    np.testing.assert_allclose(OnnxRuntime(exported.path).run(x), expected, atol=1e-5)

    keys = tmp_path / "keys"
    signing.generate_keypair(keys / "signing.key", keys / "signing.pub")
    old = PackageConfig(target="orin-jp5.1")
    with pytest.raises(UnsupportedOnnx, match="for target orin-jp5.1 .*opset 18 is outside TensorRT 8.5's 1–17"):
        package(old, build_manifest(old, "imported", "1", exported, IOSpec.from_file(spec), {}, None), exported, keys,
                tmp_path / "old.tar")
    assert not (tmp_path / "old.tar").exists()
    cfg = PackageConfig(target="orin-jp6.1")
    manifest = build_manifest(cfg, "imported", "1", exported, IOSpec.from_file(spec), {"source": source.name}, None)
    art = package(cfg, manifest, exported, keys, tmp_path / "b.tar")
    (tmp_path / "x").mkdir()
    bundle.extract(art.path, tmp_path / "x", 1 << 24)
    m = bundle.verify_dir(tmp_path / "x", signing.load_trusted([keys / "signing.pub"]))
    assert m["io"]["input"]["name"] == "obs" and m["io"]["output"]["default"] == [0.1]
    assert m["io"]["input"]["terms"][0] == {"name": "cart_pos", "unit": "m", "low": -2.4, "high": 2.4}
    assert smoke_test(tmp_path / "x", m).max_abs_error < 1e-5


def test_spec_errors_name_the_file_and_field(runner_checkpoint, tmp_path):
    bad = tmp_path / "io.yaml"
    bad.write_text(SPEC_YAML.replace("default: 0.1", "default: 3.0"))
    with pytest.raises(ValueError, match=r"io.yaml: actions.0: .*default 3.0 is outside \[-1.0, 1.0\]"):
        IOSpec.from_file(bad)
    bad.write_text(SPEC_YAML.replace("control_period_s: 0.02", "control_period_s: -1"))
    with pytest.raises(ValueError, match="io.yaml: control_period_s: .*greater than 0"):
        IOSpec.from_file(bad)
    short = tmp_path / "short.json"
    bad.write_text(SPEC_YAML)
    spec = IOSpec.from_file(bad)
    short.write_text(json.dumps({**spec.model_dump(), "observations": [o.model_dump() for o in spec.observations[:4]]}))
    with pytest.raises(PolicyImportError, match="model_1.pt takes 5 observations, .*short.json lists 4"):
        import_checkpoint(ExportConfig(), runner_checkpoint[0], short, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_not_a_checkpoint_and_parity_failure(runner_checkpoint, spec, tmp_path):
    junk = tmp_path / "junk.pt"
    torch.save({"weights": torch.zeros(3)}, junk)
    with pytest.raises(PolicyImportError, match="junk.pt: no actor_state_dict or model_state_dict .*weights"):
        read_rsl_rl_checkpoint(junk)
    with pytest.raises(ParityError, match="at input"):
        import_checkpoint(ExportConfig(atol=1e-12, rtol=0.0), runner_checkpoint[0], spec, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists(), "a failed import leaves no artifact"
