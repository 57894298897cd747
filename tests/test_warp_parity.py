"""The MuJoCo Warp backend steps every built-in task as C MuJoCo does, within float32 precision.

Warp computes in float32, C MuJoCo in float64, so the two drift apart slowly. Measured over 60 control steps of 8
environments with randomized physics (friction and armature included), joint pushes and random actions, worst of
five seeds: cart-pole qpos 5.2e-4, qvel and obs 1.9e-3 (the pole is chaotic near the top); quadruped (floor
contacts) qpos 1.3e-5, qvel and obs 7.7e-4, sensordata 8.1e-5; reacher qvel 1.3e-4; arm6 qvel 1.5e-5. The
tolerances allow ~4x that. Without per-world physics (every world the nominal model) the differences are 0.1-14.
The first run compiles warp's CPU kernels (71 s for the four tasks on a loaded 2-core machine, 17 s cached; the
cache is ``WARP_CACHE_PATH``, by default ~/.cache/warp).
"""

from __future__ import annotations

import numpy as np
import pytest

from stages.sim import registry
from stages.sim.disturbance import Disturbance
from stages.sim.env import BatchedEnv
from stages.sim.params import Randomization

TOLERANCE = {"qpos": 2e-3, "qvel": 1e-2, "sensordata": 5e-4, "obs": 1e-2}


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names())
def test_warp_matches_mujoco(name: str) -> None:
    pytest.importorskip("mujoco_warp", reason="MuJoCo Warp (mujoco_warp) is not installed: the `warp` extra")
    task = registry.load(name)
    envs = [BatchedEnv(task, 8, randomization=Randomization(armature=0.1, friction=0.05), seed=3, terminate=False,
                       disturbance=Disturbance(push=0.2, push_every=10), backend=backend)
            for backend in ("mujoco", "warp")]
    gains = envs[1]._warp.model.actuator_gainprm.numpy()[:, :, 0]
    assert np.ptp(gains, axis=0).max() > 0, "each world has its own physics"
    rng = np.random.default_rng(0)
    worst = dict.fromkeys(TOLERANCE, 0.0)
    for _ in range(60):  # the reacher's episodes end at 50: its resets re-randomize the worlds
        action = rng.uniform(-1, 1, (8, task.model.nu)).astype(np.float32)
        c, w = (env.step(action) for env in envs)
        pairs = {"qpos": (c.qpos, w.qpos), "qvel": (envs[0].qvel, envs[1].qvel),
                 "sensordata": (envs[0].sensordata, envs[1].sensordata), "obs": (c.obs, w.obs)}
        for key, (a, b) in pairs.items():
            worst[key] = max(worst[key], float(np.abs(a - b).max(initial=0.0)))
        assert np.array_equal(c.done, w.done)
    assert all(worst[k] <= TOLERANCE[k] for k in TOLERANCE), worst


@pytest.mark.slow
def test_dropped_constraints_are_refused() -> None:
    mjw = pytest.importorskip("mujoco_warp", reason="MuJoCo Warp (mujoco_warp) is not installed: the `warp` extra")
    env = BatchedEnv(registry.load("cartpole"), 2, backend="warp")
    env._warp.data.overflow.assign(np.array([0, int(mjw.OverflowType.NEFC)], dtype=np.int32))
    with pytest.raises(RuntimeError, match=r"NEFC.*in worlds \[1\]"):
        env.step(np.zeros((2, 1), dtype=np.float32))


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend must be"):
        BatchedEnv(registry.load("cartpole"), 2, backend="jax")


@pytest.mark.slow
def test_training_runs_on_warp(tmp_path) -> None:
    """``TrainConfig.backend='warp'`` trains on Warp's physics (evaluation stays on C MuJoCo)."""
    pytest.importorskip("mujoco_warp", reason="MuJoCo Warp (mujoco_warp) is not installed: the `warp` extra")
    from stages.train import train
    from stages.train_config import TrainConfig

    seen = []
    ckpt = train(TrainConfig(backend="warp", iterations=3, num_envs=16, steps_per_env=16, eval_every=3, eval_episodes=4),
                 registry.load("cartpole").nominal_params(), tmp_path / "ck", on_iteration=lambda it, m: seen.append(m))
    assert ckpt.iterations == 3 and ckpt.path.exists()
    assert all(np.isfinite(m["eval_return"]) for m in seen if "eval_return" in m) and len(seen) == 3
