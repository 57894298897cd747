"""Batched env throughput vs raw physics for the same model and step count, in one run.

(a) ``BatchedEnv.step`` (obs, reward, termination, auto-reset, randomized per-env models),
(b) raw ``mujoco.rollout`` of the same models, decimation and env count, nothing else,
(c) a Python loop of ``mj_step`` over the envs (what a hand-written vector env does);
for ``--task reacher`` also (d) gymnasium's ``SyncVectorEnv`` × 8 of ``Reacher-v5`` and (e) envpool
× ``--envs`` of ``Reacher-v5`` on 2 threads, when envpool is installed (``pip install -e '.[bench]'``).
Targets for reacher: ≥ 0.75 × raw physics, ≥ 0.8 × envpool, ≥ 3 × SyncVectorEnv.
Run: .venv/bin/python benchmarks/env_throughput.py [--task cartpole|reacher] [--envs 64]
"""

from __future__ import annotations

import argparse
import copy
import time

import mujoco
import numpy as np
from mujoco import rollout

from stages.sim.env import STATE_SPEC, BatchedEnv
from stages.sim.registry import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="cartpole")
    ap.add_argument("--envs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    task, n, steps = load(args.task), args.envs, args.steps
    actions = np.random.default_rng(0).uniform(-1, 1, (steps, n, task.act_dim)).astype(np.float32)

    env = BatchedEnv(task, n, randomization=task.randomization, seed=0)
    start = time.perf_counter()
    for a in actions:
        env.step(a)
    t_env = time.perf_counter() - start

    models = [copy.deepcopy(m) for m in env.models]
    datas = [mujoco.MjData(task.model) for _ in range(2)]
    pool = rollout.Rollout(nthread=2)
    nstate = mujoco.mj_stateSize(task.model, STATE_SPEC)
    state = env.state.copy()
    out = np.zeros((n, task.decimation, nstate))
    sens = np.zeros((n, task.decimation, task.model.nsensordata))
    ctrl = np.repeat(actions.astype(np.float64)[:, :, None, :], task.decimation, axis=2)
    start = time.perf_counter()
    for c in ctrl:
        pool.rollout(models, datas, state, c, nstep=task.decimation, skip_checks=True, state=out, sensordata=sens,
                     chunk_size=env.chunk_size)  # the env's own chunking: the reference gets the same speed-up
        state[:] = out[:, -1]
    t_raw = time.perf_counter() - start

    loop_datas = [mujoco.MjData(m) for m in models]
    start = time.perf_counter()
    for a in actions[: steps // 4]:
        for m, d, ai in zip(models, loop_datas, a):
            d.ctrl[:] = ai
            mujoco.mj_step(m, d, nstep=task.decimation)
    t_loop = (time.perf_counter() - start) * 4

    rate = lambda t: n * steps / t  # noqa: E731
    print(f"{args.task}, {n} envs, {steps} control steps × {task.decimation} physics steps, 2 threads")
    print(f"  BatchedEnv.step     {rate(t_env):10.0f} env-steps/s")
    print(f"  raw rollout         {rate(t_raw):10.0f} env-steps/s   ratio env/raw  {t_raw / t_env:.2f}")
    print(f"  python mj_step loop {rate(t_loop):10.0f} env-steps/s   ratio env/loop {t_loop / t_env:.2f}")
    if args.task == "reacher":
        for name, env_steps_per_s in gymnasium_references(n, steps, actions):
            print(f"  {name:19s} {env_steps_per_s:10.0f} env-steps/s   ratio {rate(t_env) / env_steps_per_s:.2f}")


def gymnasium_references(n: int, steps: int, actions: np.ndarray):
    """(name, env-steps/s) of gymnasium's SyncVectorEnv × 8 and, if installed, envpool × n of Reacher-v5."""
    import gymnasium as gym

    vec = gym.vector.SyncVectorEnv([lambda: gym.make("Reacher-v5") for _ in range(8)])
    vec.reset(seed=0)
    start = time.perf_counter()
    for a in actions[: steps // 4]:
        vec.step(a[:8])
    yield "SyncVectorEnv × 8", 8 * (steps // 4) / (time.perf_counter() - start)
    try:
        import envpool
    except ImportError:
        print("  envpool: not installed (pip install -e '.[bench]')")
        return
    pool = envpool.make("Reacher-v5", env_type="gymnasium", num_envs=n, num_threads=2, seed=0)
    pool.reset()
    start = time.perf_counter()
    for a in actions:
        pool.step(a)
    yield f"envpool × {n}", n * steps / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
