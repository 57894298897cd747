"""collector="process": rollouts collected in a spawned child process learn cart-pole like the sequential loop
(one policy lag slower), the child's failures reach the learner by name, and no child outlives ``train``."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch

from stages.process_sampler import CollectorError
from stages.sim.params import PhysicalParams
from stages.train import NonFiniteTraining, TrainConfig, load_actor, train

CFG = TrainConfig(iterations=15, num_envs=64, steps_per_env=32, collector="process")
TWIN = PhysicalParams()
BAR = 35.0
"""Cart-pole's mean episode return in the last iteration: ~21 in the first; 15 iterations reach ~71 sequentially
and ~48 with the one-policy lag (this machine, seed 0)."""


def children() -> list[multiprocessing.Process]:
    """The rollout processes alive now (other tests' processes aside)."""
    return [p for p in multiprocessing.active_children() if p.name == "sim2edge-rollout"]


def test_the_process_collector_learns_cartpole_and_leaves_no_child(tmp_path):
    seen: list[dict] = []
    ckpt = train(CFG, TWIN, tmp_path / "p", on_iteration=lambda it, m: seen.append(m))
    assert children() == []
    sequential: list[dict] = []
    train(CFG.model_copy(update={"collector": "sequential"}), TWIN, tmp_path / "s",
          on_iteration=lambda it, m: sequential.append(m))
    assert len(seen) == ckpt.iterations == 15
    assert seen[0]["mean_return"] < BAR < seen[-1]["mean_return"] and sequential[-1]["mean_return"] > BAR
    assert all(m["episodes"] > 0 and m["collect_time_s"] > 0 for m in seen)  # the child's episodes reach the metrics
    saved = torch.load(ckpt.path, weights_only=False)["actor_state_dict"]
    assert saved["obs_normalizer.count"] == 15 * 64 * 32  # the learner's normalizer saw every rollout once


def test_a_nan_reward_in_the_child_stops_training_by_name(own_task, tmp_path):
    from tests.test_resume import TINY, Diverging

    own_task("diverging", Diverging)  # the task object travels to the child: registered names need no entry point
    with pytest.raises(NonFiniteTraining, match=r"iteration 2: training diverged \(NaN/Inf in task 'cartpole': reward"):
        train(TINY.model_copy(update={"task": "diverging", "collector": "process"}), TWIN, tmp_path / "d")
    assert children() == []
    assert all(torch.isfinite(p).all() for p in load_actor(tmp_path / "d" / "model.pt").parameters())


def test_a_dead_child_and_ctrl_c_stop_training_with_no_child_left(tmp_path):
    def kill_child(it: int, metrics: dict) -> None:
        if it == 1:
            (child,) = children()
            os.kill(child.pid, signal.SIGKILL)

    with pytest.raises(CollectorError, match=r"the rollout process exited \(code -9\)"):
        train(CFG.model_copy(update={"iterations": 4}), TWIN, tmp_path / "k", on_iteration=kill_child)
    assert children() == []

    def interrupt(it: int, metrics: dict) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(CFG.model_copy(update={"iterations": 4}), TWIN, tmp_path / "i", on_iteration=interrupt)
    assert children() == []


def test_resume_and_periodic_checkpoints_are_refused_and_overlap_still_means_the_thread(tmp_path):
    with pytest.raises(ValueError, match="collector='process' cannot resume or write periodic checkpoints"):
        train(CFG.model_copy(update={"checkpoint_every": 5}), TWIN, tmp_path / "c")
    with pytest.raises(ValueError, match="collector='process' cannot resume"):
        train(CFG, TWIN, tmp_path / "r", resume=tmp_path / "model.pt")
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="overlap=True means collector='thread'"):
        TrainConfig(overlap=True, collector="process")
    old = {k: v for k, v in TrainConfig(overlap=True).model_dump(mode="json").items() if k != "collector"}
    assert TrainConfig(**old).collector == "sequential"  # an older checkpoint's config loads; overlap picks the thread
