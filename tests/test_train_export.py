"""PPO training (rsl_rl), checkpoints, and ONNX export with parity."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from edge.runtime import OnnxRuntime
from stages.export import ExportConfig, ParityError, export
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.rsl_env import RslRlEnv, rsl_rl_config
from stages.train import deterministic_return, load_actor, train
from stages.train_config import TrainConfig

TINY = TrainConfig(iterations=2, num_envs=8, steps_per_env=8, hidden_dims=(16, 16))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return train(TINY, PhysicalParams(), tmp_path_factory.mktemp("ck") / "checkpoint")


def actor_weights(path):
    return torch.load(path, weights_only=False)["actor_state_dict"]


def test_same_seed_same_weights_different_seed_differs(checkpoint, tmp_path):
    again = train(TINY, PhysicalParams(), tmp_path / "again")
    other = train(TINY.model_copy(update={"seed": 1}), PhysicalParams(), tmp_path / "other")
    a, b, c = (actor_weights(p.path) for p in (checkpoint, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_metrics_reported_per_iteration(tmp_path):
    seen = []
    train(TINY, PhysicalParams(), tmp_path / "ck", on_iteration=lambda it, m: seen.append((it, m)))
    assert [it for it, _ in seen] == [0, 1]
    assert {"mean_return", "env_steps_per_s", "update_time_s", "collect_time_s", "sample_time_share"} <= set(seen[0][1])
    assert all(0 < m["sample_time_share"] < 1 for _, m in seen)
    assert all(np.isnan(m["mean_episode_length"]) for _, m in seen if m["episodes"] == 0)
    steps = load("cartpole").episode_steps
    long = []
    train(TINY.model_copy(update={"iterations": 1, "steps_per_env": steps + 1}), PhysicalParams(), tmp_path / "l",
          on_iteration=lambda it, m: long.append(m))
    assert long[0]["episodes"] >= 8 and 1 <= long[0]["mean_episode_length"] <= steps


def test_deterministic_evaluation_is_repeatable_and_stops_at_the_target(tmp_path):
    seen = []
    cfg = TINY.model_copy(update={"iterations": 5, "eval_every": 2, "eval_episodes": 4})
    full = train(cfg, PhysicalParams(), tmp_path / "full", on_iteration=lambda it, m: seen.append(m))
    assert ["eval_return" in m for m in seen] == [False, True, False, True, False] and full.iterations == 5
    actor = load_actor(full.path)
    task = load("cartpole")
    assert deterministic_return(actor, task, PhysicalParams(), 4, 1) == deterministic_return(actor, task, PhysicalParams(), 4, 1)
    first = seen[1]["eval_return"]
    early = train(cfg.model_copy(update={"target_return": first}), PhysicalParams(), tmp_path / "early")
    assert early.iterations == 2 and torch.load(early.path, weights_only=False)["iter"] == 2


def test_checkpoint_round_trips_with_normalizer(checkpoint):
    saved = actor_weights(checkpoint.path)
    mean = saved["obs_normalizer._mean"]
    assert not torch.allclose(mean, torch.zeros_like(mean)), "normalizer statistics should be trained"
    actor = load_actor(checkpoint.path)
    assert all(torch.equal(actor.state_dict()[k], saved[k]) for k in saved)


def test_checkpoint_loads_into_rsl_rl_runner(checkpoint):
    from rsl_rl.runners import OnPolicyRunner

    from stages.sim.env import BatchedEnv

    env = RslRlEnv(BatchedEnv(load("cartpole"), TINY.num_envs))
    cfg = {**rsl_rl_config(TINY), "save_interval": 50, "logger": "tensorboard"}
    runner = OnPolicyRunner(env, cfg, log_dir=None)
    runner.load(str(checkpoint.path))
    policy = runner.get_inference_policy()
    assert torch.equal(policy.obs_normalizer.mean, actor_weights(checkpoint.path)["obs_normalizer._mean"].squeeze(0))


def test_export_puts_normalization_and_action_scaling_in_the_graph(checkpoint, tmp_path):
    exported = export(ExportConfig(parity_samples=200), checkpoint, tmp_path / "onnx")
    model = onnx.load(str(exported.path))
    assert model.opset_import[0].version == 17
    assert [i.name for i in model.graph.input] == ["obs"] and [o.name for o in model.graph.output] == ["action"]
    actor = load_actor(checkpoint.path)
    norm = actor.obs_normalizer
    x = np.random.default_rng(0).normal(size=(50, 5)).astype(np.float32) * 3
    with torch.no_grad():
        z = (torch.from_numpy(x) - norm.mean) / (norm.std + norm.eps)
        expected = torch.clamp(actor.mlp(z)[:, :1], -1, 1).numpy()  # cart-pole: scale 1, default 0
    got = OnnxRuntime(exported.path).run(x)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    batch = OnnxRuntime(exported.path).run(np.zeros((7, 5), np.float32))
    assert batch.shape == (7, 1)
    golden = np.load(exported.golden)
    np.testing.assert_allclose(OnnxRuntime(exported.path).run(golden["inputs"]), golden["outputs"], atol=1e-5)
    unsaturated = np.abs(golden["outputs"]) < 1 - 1e-6  # cart-pole: inside the ±1 clip
    assert exported.golden_unsaturated_fraction == unsaturated.mean() >= 0.75


def test_parity_failure_names_the_worst_input(checkpoint, tmp_path):
    with pytest.raises(ParityError, match="at input \\["):
        export(ExportConfig(parity_samples=100, atol=1e-12, rtol=0.0), checkpoint, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists(), "a failed export leaves no artifact"


def test_a_device_torch_cannot_use_is_refused_in_one_line_before_training(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the refusal is for one without (benchmarks/gpu_check.py trains on it)")
    with pytest.raises(ValueError, match=r"^train.device 'cuda': torch .* sees no CUDA device here"):
        train(TINY.model_copy(update={"device": "cuda"}), PhysicalParams(), tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    with pytest.raises(ValueError, match="device"):
        TrainConfig(device="gpu")
