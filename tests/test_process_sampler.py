"""collector="process": rollouts collected in a spawned child process learn cart-pole like the sequential loop
(one policy lag slower), the child's failures reach the learner by name, and no child outlives ``train``."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal

import pytest
import torch

from stages.process_sampler import CollectorError
from stages.sim.params import PhysicalParams
from stages.train import NonFiniteTraining, load_actor, train
from stages.train_config import TrainConfig

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


def test_a_process_collected_run_resumes_exactly_from_a_periodic_or_a_final_checkpoint(tmp_path):
    """The policy lag is part of the state: a run with two rollout processes, crashed after its periodic checkpoint
    (children mid-rollout) or extended from its final one (children idle), continues bit for bit as the
    uninterrupted run; the sequential run, one policy lag apart, differs."""
    from tests.test_train_resume import CFG as SMALL, Crash, assert_same, crash_at, states

    cfg = SMALL.model_copy(update={"collector": "process", "collector_processes": 2})
    straight = train(cfg, TWIN, tmp_path / "straight")
    crashed = cfg.model_copy(update={"checkpoint_every": 2})
    with pytest.raises(Crash):
        train(crashed, TWIN, tmp_path / "crashed", on_iteration=crash_at(2))
    assert children() == []
    seen: list[int] = []
    resumed = train(crashed, TWIN, tmp_path / "resumed", on_iteration=lambda it, m: seen.append(it),
                    resume=tmp_path / "crashed" / "model.pt")
    assert seen == [2, 3] and resumed.iterations == straight.iterations == 4
    assert_same(states(resumed.path), states(straight.path))
    short = train(cfg.model_copy(update={"iterations": 2}), TWIN, tmp_path / "short")
    extended = train(cfg, TWIN, tmp_path / "extended", resume=short.path)
    assert_same(states(extended.path), states(straight.path))
    assert children() == []
    sequential = train(SMALL, TWIN, tmp_path / "sequential")
    with pytest.raises(AssertionError):
        assert_same(states(sequential.path), states(straight.path))  # the comparison can fail


def test_overlap_still_means_the_thread():
    with pytest.raises(ValueError, match="overlap=True means collector='thread'"):
        TrainConfig(overlap=True, collector="process")
    old = {k: v for k, v in TrainConfig(overlap=True).model_dump(mode="json").items() if k != "collector"}
    assert TrainConfig(**old).collector == "sequential"  # an older checkpoint's config loads; overlap picks the thread


def test_two_collector_processes_fill_both_slices_and_train_cartpole(tmp_path):
    """K=2: each child writes its half of the environment columns, the advantages are normalized over the whole
    batch, every done in the rollout is a finished episode the learner sees, and no child outlives train."""
    from stages.process_sampler import ProcessSampler
    from stages.sim.registry import load
    from stages.rsl_env import RslRlEnv, build_algorithm, make_env

    cfg = TrainConfig(iterations=3, num_envs=16, steps_per_env=32, collector="process", collector_processes=2)
    task = load(cfg.task)
    vec_env = RslRlEnv(make_env(cfg, task, TWIN))
    alg = build_algorithm(cfg, vec_env)
    sampler = ProcessSampler(alg, vec_env, cfg, task, TWIN)
    try:
        assert len(children()) == 2
        with sampler.rollout(more=False) as collected:
            storage = alg.storage
            assert collected.seconds > 0 and storage.step == 32
            written = storage.observations["policy"].abs().sum(dim=(0, 2))
            assert (written > 0).all() and (storage.actions_log_prob != 0).any(dim=0).all()  # all 16 columns
            assert not torch.equal(storage.actions[:, :8], storage.actions[:, 8:])  # the children's own noise
            assert abs(storage.advantages.mean()) < 1e-5 and abs(storage.advantages.std() - 1) < 1e-4
            assert torch.allclose(storage.returns - storage.values,
                                  storage.advantages * (storage.returns - storage.values).std()
                                  + (storage.returns - storage.values).mean(), atol=1e-4)
            dones = storage.dones.squeeze(-1)
            assert (dones.sum(dim=0)[:8] > 0).any() and (dones.sum(dim=0)[8:] > 0).any()
        assert len(vec_env.finished.take().returns) == int(dones.sum())  # both children's episodes, each once
    finally:
        sampler.close()
    assert children() == []

    seen: list[dict] = []
    train(cfg, TWIN, tmp_path / "k2", on_iteration=lambda it, m: seen.append(m))
    assert children() == [] and len(seen) == 3
    assert all(m["episodes"] > 0 and math.isfinite(m["mean_return"]) for m in seen)


def test_a_failing_child_of_several_is_named_and_all_are_stopped(tmp_path):
    def kill_second(it: int, metrics: dict) -> None:
        if it == 1:
            os.kill(children()[1].pid, signal.SIGKILL)

    cfg = CFG.model_copy(update={"iterations": 4, "num_envs": 16, "collector_processes": 2})
    with pytest.raises(CollectorError, match=r"rollout process \d of 2 exited \(code -9\)"):
        train(cfg, TWIN, tmp_path / "k", on_iteration=kill_second)
    assert children() == []


def test_collector_processes_are_refused_without_the_process_collector_or_an_even_split():
    with pytest.raises(ValueError, match=r"collector_processes=2 needs collector='process' \(got collector='thread'"):
        TrainConfig(collector="thread", collector_processes=2)
    with pytest.raises(ValueError, match="collector_processes=3 must divide num_envs=64"):
        TrainConfig(num_envs=64, collector="process", collector_processes=3)
    with pytest.raises(ValueError, match="collector_processes=4 must divide num_envs=2"):
        TrainConfig(num_envs=2, collector="process", collector_processes=4)
    assert TrainConfig(num_envs=64, collector="process", collector_processes=4).collector_processes == 4
