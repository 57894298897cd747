"""How does rollout collection scale over collector processes (``TrainConfig.collector_processes``, issue #23)?

Collection alone, no update: the same ``--envs`` cart-pole environments (strong scaling) split over K spawned
rollout processes (:class:`stages.process_sampler.ProcessSampler`), K = 1, 2, 4, … up to ``os.cpu_count()`` (and
the count itself), each child with ``--nthread`` physics threads and one torch thread. Per K: ``--rollouts``
rollouts of ``--steps`` steps after one warm-up rollout (which waits for the children to start), each timed at
the learner from its request until the rollout is in ``alg.storage`` (the copy into it included).
Prints env-steps/s per K and its ratio to K = 1 measured in the same run, and the load average (the ratio is
meaningless on a machine busy with other work).
Run: PYTHONPATH=. .venv/bin/python benchmarks/collector_scaling.py [--envs 256] [--steps 32] [--rollouts 5]
     [--ks 1,2,4] [--nthread 1] [--task cartpole]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from stages.process_sampler import ProcessSampler
from stages.sim.registry import load
from stages.rsl_env import RslRlEnv, build_algorithm, make_env
from stages.train import torch_threads
from stages.train_config import TrainConfig


def default_ks(cores: int) -> list[int]:
    """1, 2, 4, … up to ``cores``, and ``cores`` itself."""
    ks, k = [], 1
    while k <= cores:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == cores else [*ks, cores]


def collect_rate(cfg: TrainConfig, rollouts: int) -> dict:
    """Env-steps/s of ``rollouts`` collections (after a warm-up one) with ``cfg.collector_processes`` children."""
    task = load(cfg.task)
    twin = task.nominal_params()
    torch.manual_seed(cfg.seed)
    vec_env = RslRlEnv(make_env(cfg, task, twin))
    alg = build_algorithm(cfg, vec_env)
    sampler = ProcessSampler(alg, vec_env, cfg, task, twin)
    walls, child = [], []
    try:
        for i in range(rollouts + 1):
            start = time.perf_counter()
            with sampler.rollout(more=False) as collected:
                pass
            if i:  # the first one waits for the children to start
                walls.append(time.perf_counter() - start)
                child.append(collected.seconds)
    finally:
        sampler.close()
    steps = cfg.num_envs * cfg.steps_per_env
    return {"env_steps_per_s": round(steps / statistics.median(walls)),
            "slowest_child_env_steps_per_s": round(steps / statistics.median(child))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="cartpole")
    parser.add_argument("--envs", type=int, default=256, help="Environments in all (split over the K processes).")
    parser.add_argument("--steps", type=int, default=32, help="Steps per environment per rollout.")
    parser.add_argument("--rollouts", type=int, default=5, help="Timed rollouts per K (after one warm-up).")
    parser.add_argument("--nthread", type=int, default=1, help="Physics threads per collector process.")
    parser.add_argument("--ks", help="Comma-separated process counts (default: 1, 2, 4, … up to os.cpu_count()).")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    ks = [int(k) for k in args.ks.split(",")] if args.ks else default_ks(cores)
    report = {"cores": cores, "envs": args.envs, "steps": args.steps, "nthread": args.nthread,
              "load_before": [round(x, 2) for x in os.getloadavg()], "k": {}}
    with torch_threads(1):
        for k in ks:
            if args.envs % k:
                print(f"K={k:>3}: skipped ({args.envs} environments do not split into {k})")
                continue
            cfg = TrainConfig(task=args.task, num_envs=args.envs, steps_per_env=args.steps, nthread=args.nthread,
                              collector="process", collector_processes=k)
            report["k"][k] = collect_rate(cfg, args.rollouts)
    base = report["k"].get(1, {}).get("env_steps_per_s")
    for k, r in report["k"].items():
        r["ratio_to_k1"] = round(r["env_steps_per_s"] / base, 2) if base else None
        print(f"K={k:>3}: {r['env_steps_per_s']:>9} env-steps/s  ×{r['ratio_to_k1']}  "
              f"(slowest child alone {r['slowest_child_env_steps_per_s']})")
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"{cores} cores; load average before {report['load_before']}, after {report['load_after']}")
    return report


if __name__ == "__main__":
    main()
