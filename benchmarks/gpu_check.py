"""The GPU check: what a lent GPU machine measures of sim2edge in one short run.

``benchmarks/gpu_check.sh`` runs it on the GPU machine after installing the carried wheels (``make gpu-wheels``);
``PYTHONPATH=. .venv/bin/python benchmarks/gpu_check.py --device cpu --quick`` runs the same steps here, on the CPU
against itself (tests/test_gpu_check.py). Each step compares the device with the CPU in the same run:

1. ``machine``: torch and its CUDA, the device's name and memory, mujoco, onnxruntime's providers.
2. ``update``: rsl_rl's PPO update (5 epochs × 4 minibatches) on one stored cart-pole rollout at two sizes, the
   shipped presets' (128 envs × 32 steps, 64-64) and a legged-robot one (4096 × 24, 512-256-128), CPU and device
   interleaved round by round: median ms per update and the device's speed-up. The whole run takes a few
   minutes on the GPU machine's 16 cores (estimated, not yet run there).
3. ``train``: cart-pole trained through ``stages.train.train`` with the same seed and budget on each: wall time per
   iteration, the share spent collecting (the physics stays on the CPU) and the final deterministic return.
4. ``export``: the device-trained checkpoint exported to ONNX with the export stage's parity check (onnxruntime,
   CPU), then batch-1 latency p50 per onnxruntime provider available (CUDA, TensorRT where installed).

5. ``collectors`` (with ``--collectors`` only): rollout collection alone over 1, 2, 4, … up to the machine's cores
   collector processes (``TrainConfig.collector_processes``, 1,024 cart-pole environments split among them),
   env-steps/s and the ratio to one process (benchmarks/collector_scaling.py).

Output: a table on stdout and ``--out`` (JSON). MuJoCo Warp is not here: warp-lang's wheel (149 MB) does not fit
the GPU machine's 64 MiB of carried files.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mujoco
import numpy as np
import torch

from stages.export import ExportConfig, export
from stages.sim.env import BatchedEnv
from stages.sim.registry import load
from stages.rsl_env import RslRlEnv, build_algorithm
from stages.samplers import Sampler
from stages.train import check_device, torch_threads, train
from stages.train_config import TrainConfig

SIZES = {"preset (128×32, 64-64)": (128, 32, (64, 64)), "legged (4096×24, 512-256-128)": (4096, 24, (512, 256, 128))}
PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
QUICK_SIZES = {"preset (32×8, 16-16)": (32, 8, (16, 16)), "wide (256×8, 128-128)": (256, 8, (128, 128))}


def machine(device: str) -> dict:
    import onnxruntime as ort

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "mujoco": mujoco.__version__, "onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
           "device": device}
    if device != "cpu":
        props = torch.cuda.get_device_properties(torch.device(device))
        out |= {"device_name": props.name, "device_memory_gib": round(props.total_memory / 2**30, 1)}
    return out


def stored_rollout(device: str, envs: int, steps: int, hidden: tuple[int, ...]):
    """PPO on ``device`` with one cart-pole rollout in its storage (collected with the physics on all cores)."""
    cfg = TrainConfig(num_envs=envs, steps_per_env=steps, hidden_dims=hidden, device=device)
    task = load(cfg.task)
    vec = RslRlEnv(BatchedEnv(task, envs, params=task.nominal_params(), seed=0, nthread=torch.get_num_threads()),
                   device)
    torch.manual_seed(0)
    alg = build_algorithm(cfg, vec)
    Sampler(alg, vec, cfg)._collect(alg)
    return alg


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(torch.device(device))


def update_ms(alg, stored, device: str, reps: int) -> float:
    """Median ms of ``reps`` PPO updates on copies of ``stored`` (after one warm-up)."""
    times = []
    for i in range(reps + 1):
        work = copy.deepcopy(alg)
        work.storage = copy.deepcopy(stored)
        synchronize(device)
        start = time.perf_counter()
        work.update()
        synchronize(device)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def update_step(device: str, sizes: dict, rounds: int, reps: int) -> dict:
    out = {}
    for name, size in sizes.items():
        algs = {d: stored_rollout(d, *size) for d in dict.fromkeys(("cpu", device))}
        times: dict[str, list[float]] = {d: [] for d in algs}
        for _ in range(rounds):
            for d, alg in algs.items():
                times[d].append(update_ms(alg, alg.storage, d, reps))
        cpu, dev = statistics.median(times["cpu"]), statistics.median(times[device])
        out[name] = {"cpu_ms": round(cpu, 2), "device_ms": round(dev, 2), "speedup": round(cpu / dev, 2)}
    return out


def train_step(device: str, iterations: int, envs: int, out_dir: Path) -> tuple[dict, object]:
    results, checkpoint = {}, None
    for d in dict.fromkeys(("cpu", device)):
        seconds, shares = [], []
        cfg = TrainConfig(iterations=iterations, num_envs=envs, eval_every=iterations, device=d, seed=0,
                          nthread=torch.get_num_threads())
        final = {}
        start = time.perf_counter()
        ckpt = train(cfg, load(cfg.task).nominal_params(), out_dir / d.replace(":", "_"),
                     on_iteration=lambda it, m: (seconds.append(m["iteration_time_s"]),
                                                 shares.append(m["sample_time_share"]), final.update(m)))
        results[d] = {"wall_s": round(time.perf_counter() - start, 2),
                      "iteration_ms_median": round(statistics.median(seconds[1:] or seconds) * 1e3, 1),
                      "collect_share": round(statistics.median(shares), 3),
                      "eval_return": round(final.get("eval_return", float("nan")), 2)}
        checkpoint = ckpt
    results["iteration_speedup"] = round(results["cpu"]["iteration_ms_median"]
                                         / results[device]["iteration_ms_median"], 2)
    return results, checkpoint


def export_step(checkpoint, out_dir: Path, calls: int) -> dict:
    import onnxruntime as ort

    from edge.runtime import OnnxRuntime

    exported = export(ExportConfig(), checkpoint, out_dir / "export")
    x = np.zeros((1, load(checkpoint.task).obs_dim), np.float32)
    latency = {}
    for provider in [p for p in ort.get_available_providers() if p in PROVIDERS]:
        runtime = OnnxRuntime(exported.path, providers=(provider,))
        if runtime.providers[0] != provider:
            continue
        start = time.perf_counter()
        runtime.run(x)
        first = (time.perf_counter() - start) * 1e3
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            runtime.run(x)
            times.append((time.perf_counter() - start) * 1e6)
        latency[provider] = {"first_ms": round(first, 2), "p50_us": round(float(np.percentile(times, 50)), 1)}
    return {"parity_max_abs_error": exported.parity_max_abs_error, "latency_batch1": latency}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="The device to compare with the CPU (cuda, cuda:N, cpu).")
    parser.add_argument("--quick", action="store_true", help="Small sizes and budgets: a smoke run of every step.")
    parser.add_argument("--out", type=Path, help="Write the results here (JSON).")
    parser.add_argument("--collectors", action="store_true", help="Also measure collection over 1, 2, 4, … "
                        "collector processes (benchmarks/collector_scaling.py).")
    args = parser.parse_args(argv)
    try:
        check_device(args.device)
    except ValueError as e:
        sys.exit(f"gpu_check: {e}")
    quick = args.quick
    # tiny networks in --quick: one torch thread (more only add hand-offs; benchmarks/update_threads.py)
    with torch_threads(1 if quick else torch.get_num_threads()):
        report = {"machine": machine(args.device)}
        # the legged size is ~1 TFLOP per update: a few seconds each on 16 CPU cores, so few repetitions
        report["update"] = update_step(args.device, QUICK_SIZES if quick else SIZES, 1 if quick else 2, 2)
        with tempfile.TemporaryDirectory() as tmp:
            report["train"], checkpoint = train_step(args.device, 3 if quick else 60, 16 if quick else 256, Path(tmp))
            report["export"] = export_step(checkpoint, Path(tmp), 50 if quick else 2000)
    if args.collectors:
        from benchmarks import collector_scaling

        report["collectors"] = collector_scaling.main(["--envs", "32", "--steps", "8", "--rollouts", "2", "--ks", "1,2"]
                                                      if quick else ["--envs", "1024", "--rollouts", "5"])
    print(json.dumps(report["machine"]))
    for name, r in report["update"].items():
        print(f"PPO update {name:<32} cpu {r['cpu_ms']:9.2f} ms   {args.device} {r['device_ms']:9.2f} ms   "
              f"{r['speedup']:5.2f}×")
    t = report["train"]
    print(f"training iteration: cpu {t['cpu']['iteration_ms_median']} ms, {args.device} "
          f"{t[args.device]['iteration_ms_median']} ms ({t['iteration_speedup']}×); eval return cpu "
          f"{t['cpu']['eval_return']}, {args.device} {t[args.device]['eval_return']}")
    print(f"export parity max |error| {report['export']['parity_max_abs_error']:.2e}; batch-1 latency: "
          + ", ".join(f"{p} p50 {v['p50_us']} µs (first {v['first_ms']} ms)"
                      for p, v in report["export"]["latency_batch1"].items()))
    if "collectors" in report:
        print("collection over K processes (env-steps/s, ratio to K=1): " + ", ".join(
            f"K={k} {r['env_steps_per_s']} ({r['ratio_to_k1']}×)" for k, r in report["collectors"]["k"].items()))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
