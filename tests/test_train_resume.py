"""Resuming training from a checkpoint (optimizer, RNG and environment states included) gives exactly the
uninterrupted run; a checkpoint of another run, or one without the resume state, is refused by name."""

from __future__ import annotations

import pytest
import torch

from stages.sim.params import PhysicalParams
from stages.train import train
from stages.train_config import TrainConfig

CFG = TrainConfig(task="cartpole", iterations=4, num_envs=16, steps_per_env=16, hidden_dims=(16, 16), seed=3)
TWIN = PhysicalParams()


class Crash(Exception):
    pass


def crash_at(iteration: int):
    def on_iteration(it: int, metrics: dict) -> None:
        if it == iteration:
            raise Crash

    return on_iteration


def states(path) -> dict:
    saved = torch.load(path, weights_only=False)
    return {k: saved[k] for k in ("actor_state_dict", "critic_state_dict", "optimizer_state_dict")} | \
        {"iter": saved["iter"]}


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b) and all(assert_same(x, y) is None for x, y in zip(a, b))
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path):
    straight = train(CFG, TWIN, tmp_path / "straight")
    crashed = CFG.model_copy(update={"checkpoint_every": 2})
    with pytest.raises(Crash):
        train(crashed, TWIN, tmp_path / "crashed", on_iteration=crash_at(2))  # dies in iteration 3 of 4
    assert torch.load(tmp_path / "crashed" / "model.pt", weights_only=False)["iter"] == 2  # the periodic checkpoint
    seen = []
    resumed = train(crashed, TWIN, tmp_path / "resumed", on_iteration=lambda it, m: seen.append(it),
                    resume=tmp_path / "crashed" / "model.pt")
    assert seen == [2, 3] and resumed.iterations == straight.iterations == 4
    assert_same(states(resumed.path), states(straight.path))
    other_seed = train(CFG.model_copy(update={"seed": 4}), TWIN, tmp_path / "other")
    with pytest.raises(AssertionError):
        assert_same(states(other_seed.path), states(straight.path))  # the comparison can fail


def test_resume_refuses_another_runs_checkpoint(tmp_path):
    ckpt = train(CFG.model_copy(update={"iterations": 1}), TWIN, tmp_path / "a").path
    with pytest.raises(ValueError, match=r"different config: learning_rate 0\.001 -> 0\.002"):
        train(CFG.model_copy(update={"learning_rate": 2e-3}), TWIN, tmp_path / "b", resume=ckpt)
    with pytest.raises(ValueError, match="different twin"):
        train(CFG, PhysicalParams(damping=1.5), tmp_path / "b", resume=ckpt)
    with pytest.raises(ValueError, match="already has 1 iterations"):
        train(CFG.model_copy(update={"iterations": 1}), TWIN, tmp_path / "b", resume=ckpt)
    with pytest.raises(ValueError, match="warm_start or resume"):
        train(CFG, TWIN, tmp_path / "b", warm_start=ckpt, resume=ckpt)
    saved = torch.load(ckpt, weights_only=False)
    del saved["resume"]
    torch.save(saved, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="holds no resume state"):
        train(CFG, TWIN, tmp_path / "b", resume=tmp_path / "plain.pt")
    assert not (tmp_path / "b").exists()  # nothing half-written


def test_overlapped_collection_trains_with_one_policy_lag(tmp_path):
    """overlap=True collects the next rollout on a second thread during the update: a complete run whose
    weights differ from the sequential run's (the update sees data one policy old)."""
    seen = []
    overlapped = train(CFG.model_copy(update={"overlap": True}), TWIN, tmp_path / "o",
                       on_iteration=lambda it, m: seen.append(m))
    sequential = train(CFG, TWIN, tmp_path / "s")
    assert overlapped.iterations == 4 and len(seen) == 4
    assert all(m["collect_time_s"] > 0 and m["iteration_time_s"] > 0 and 0 < m["sample_time_share"] < 1 for m in seen)
    with pytest.raises(AssertionError):
        assert_same(states(overlapped.path), states(sequential.path))
    saved = torch.load(overlapped.path, weights_only=False)
    assert all(torch.isfinite(t).all() for t in saved["actor_state_dict"].values() if t.is_floating_point())


def test_a_diverging_overlapped_run_stops_with_a_finite_checkpoint(own_task, tmp_path):
    from stages.train import NonFiniteTraining, load_actor
    from tests.test_resume import TINY, Diverging

    own_task("diverging", Diverging)
    # the third rollout (where the reward turns NaN) is collected during iteration 1's update, and refused there
    with pytest.raises(NonFiniteTraining, match=r"iteration 1: training diverged \(NaN/Inf in task 'cartpole': reward"):
        train(TINY.model_copy(update={"task": "diverging", "overlap": True}), TWIN, tmp_path / "d")
    assert all(torch.isfinite(p).all() for p in load_actor(tmp_path / "d" / "model.pt").parameters())


def test_training_with_base_pushes_is_seeded_and_resumes_exactly(tmp_path):
    from stages.sim.disturbance import Disturbance
    from stages.sim.registry import load

    pushed = TrainConfig(task="quadruped", iterations=2, num_envs=8, steps_per_env=8, hidden_dims=(16,), seed=1,
                         disturbance=Disturbance(push=0.5, push_on="base", push_every=4, push_steps=2))
    twin = load("quadruped").nominal_params()
    straight = train(pushed, twin, tmp_path / "p")
    plain = train(pushed.model_copy(update={"disturbance": Disturbance()}), twin, tmp_path / "n")
    with pytest.raises(AssertionError):
        assert_same(states(straight.path), states(plain.path))  # the pushes reach the training data
    first = train(pushed.model_copy(update={"iterations": 1}), twin, tmp_path / "1")
    resumed = train(pushed, twin, tmp_path / "r", resume=first.path)
    assert_same(states(resumed.path), states(straight.path))
