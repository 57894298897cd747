"""Where the PPO update's time goes on a small CPU: torch threads, a fused Adam and torch.compile.

One reacher rollout (64 envs × 32 steps, the training loop's own collection) is stored once; then rsl_rl's
``PPO.update`` (5 epochs × 4 minibatches) runs on copies of it, the variants interleaved round by round so each
ratio compares times taken under the same machine load:

- ``2 threads``: torch's default here (one per core), rsl_rl's own Adam: the training loop before this change.
- ``1 thread``: ``torch.set_num_threads(1)``.
- ``1 thread + fused``: also ``torch.optim.Adam(..., fused=True)``: what ``stages.train`` uses now
  (``TrainConfig.torch_threads`` = 1, ``build_algorithm``).
- ``+ compiled``: also the actor's and critic's MLPs through ``torch.compile`` (inductor, C++ on the CPU), its
  forward and backward fused; the first update's extra time, the compilation, is printed apart (not used in training).

Then whole training iterations (collection + update) through ``stages.train.train`` with ``torch_threads`` 2
and 1. Output: the median time per update and per iteration of each, and each variant's speed-up over the first.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/update_threads.py [--rounds 3] [--iterations 20]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stages.sim.env import BatchedEnv
from stages.sim.registry import load
from stages.rsl_env import RslRlEnv, build_algorithm
from stages.samplers import Sampler
from stages.train import torch_threads, train
from stages.train_config import TrainConfig

CFG = TrainConfig(task="reacher", num_envs=64, steps_per_env=32, gamma=0.9)


def update_times(rounds: int, reps: int) -> tuple[dict[str, list[float]], list[float]]:
    """Median seconds per ``PPO.update`` of each variant, one per round; and the compiled variant's first update
    each round (compilation included)."""
    task = load(CFG.task)
    vec = RslRlEnv(BatchedEnv(task, CFG.num_envs, params=task.nominal_params(), seed=0, nthread=CFG.nthread))
    torch.manual_seed(0)
    base = build_algorithm(CFG, vec)
    Sampler(base, vec, CFG)._collect(base)
    stored = copy.deepcopy(base.storage)
    unfused = torch.optim.Adam([p for g in base.optimizer.param_groups for p in g["params"]], lr=CFG.learning_rate)
    variants = {"2 threads": (2, unfused, False), "1 thread": (1, unfused, False),
                "1 thread + fused": (1, base.optimizer, False), "+ compiled": (1, base.optimizer, True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    first_compiled: list[float] = []
    for _ in range(rounds):
        for name, (threads, optimizer, compiled) in variants.items():
            alg = copy.deepcopy(base)
            alg.optimizer = type(optimizer)(list(alg.actor.parameters()) + list(alg.critic.parameters()),
                                            **optimizer.defaults)
            if compiled:
                alg.actor.mlp, alg.critic.mlp = torch.compile(alg.actor.mlp), torch.compile(alg.critic.mlp)
            with torch_threads(threads):
                runs = []
                for _ in range(reps + compiled):
                    alg.storage = copy.deepcopy(stored)
                    start = time.perf_counter()
                    alg.update()
                    runs.append(time.perf_counter() - start)
            if compiled:
                first_compiled.append(runs.pop(0))
            times[name].append(statistics.median(runs))
    return times, first_compiled


def iteration_times(rounds: int, iterations: int) -> dict[str, list[float]]:
    """Median seconds per training iteration through ``train`` with 2 and 1 torch threads, one per round."""
    times: dict[str, list[float]] = {"train, 2 threads": [], "train, 1 thread": []}
    for _ in range(rounds):
        for name, threads in (("train, 2 threads", 2), ("train, 1 thread", 1)):
            seconds: list[float] = []
            with tempfile.TemporaryDirectory() as tmp:
                train(CFG.model_copy(update={"iterations": iterations, "torch_threads": threads}),
                      load(CFG.task).nominal_params(), Path(tmp),
                      on_iteration=lambda it, m: seconds.append(m["iteration_time_s"]))
            times[name].append(statistics.median(seconds[1:]))  # the first iteration warms up
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10, help="Updates per variant per round.")
    parser.add_argument("--iterations", type=int, default=20, help="Training iterations per variant per round.")
    args = parser.parse_args()
    updates, first_compiled = update_times(args.rounds, args.reps)
    for title, times in (("PPO update", updates), ("training iteration", iteration_times(args.rounds, args.iterations))):
        reference = statistics.median(next(iter(times.values())))
        print(f"{title} (median of {args.rounds} rounds):")
        for name, values in times.items():
            t = statistics.median(values)
            print(f"  {name:<18} {t * 1e3:8.1f} ms   {reference / t:5.2f}× the first   "
                  f"(rounds: {', '.join(f'{v * 1e3:.1f}' for v in values)} ms)")
    print(f"first compiled update per round (compilation included): {', '.join(f'{v:.1f}' for v in first_compiled)} s")


if __name__ == "__main__":
    main()
