"""HIL round trip vs in-process inference, same run: the twin at 20 ms against ``sim2edge-agent run`` on loopback.

The device serves tests/test_hil.py's linear cart-pole balancer. The runner records every action's round
trip (observation sent → action received, host clock); in-process inference is the same ONNX through
``edge.runtime.OnnxRuntime`` in this process, one observation at a time. Optionally through the relay
(``--delay`` seconds each way, ``--jitter``, ``--loss``). Prints p50/p99/max, the ratios, and the
HIL returns beside in-process evaluation's on the same seeds.

``--sweep 0,0.002,...`` instead runs ``sim2edge evaluate --hil``'s evaluation (``hil_evaluate``, the nominal
scenario, the default HIL gate) of both policies behind the relay at each one-way delay (``--jitter`` added to
every one, 0 included), and prints a markdown table: returns, falls, round trip, misses and the gate's verdict.

Run: PYTHONPATH=. .venv/bin/python benchmarks/hil_latency.py [--episodes 4] [--steps 100] [--delay 0.005]
     PYTHONPATH=. .venv/bin/python benchmarks/hil_latency.py --sweep 0,0.002,0.004,0.006,0.008,0.01,0.012
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge.runtime import OnnxRuntime  # noqa: E402
from stages.twin.episodes import run_episodes  # noqa: E402
from stages.twin.hil import HilConfig, hil_task, run_hil, twin_env  # noqa: E402
from stages.twin.hil_evaluate import HilGateConfig, HilSuiteConfig, hil_evaluate  # noqa: E402
from stages.twin.relay import Impairment, Relay  # noqa: E402
from stages.twin.suite import Scenario  # noqa: E402
from tests.test_evaluate import BALANCER, LATENCY_FRAGILE  # noqa: E402
from tests.test_hil import cartpole_store, serve, stop  # noqa: E402

POLICIES = {"balancer": BALANCER, "fragile": LATENCY_FRAGILE}
CLAUSES = {"deadline-miss": "misses", "round-trip": "RTT p99", "paired return": "return"}
"""The HIL gate's clauses, as the sweep's verdict column names the failing ones."""


def in_process_ms(onnx: Path, n: int = 5000) -> np.ndarray:
    """One-observation inference times (ms) of the same ONNX in this process."""
    runtime, x = OnnxRuntime(onnx), np.random.default_rng(0).normal(size=(1, 5)).astype(np.float32)
    for _ in range(200):
        runtime.run(x)
    times = np.empty(n)
    for i in range(n):
        start = time.perf_counter()
        runtime.run(x)
        times[i] = time.perf_counter() - start
    return times * 1e3


def sweep(delays: list[float], jitter: float, episodes: int, steps: int) -> None:
    """Per policy and one-way delay (through the relay, seeded): ``hil_evaluate`` of the nominal scenario, one row."""
    print("| policy | one-way delay ms | return in-process | return HIL | falls HIL | RTT p99 ms | misses | HIL gate |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, k in POLICIES.items():
            (Path(tmp) / name).mkdir()
            root, onnx = cartpole_store(Path(tmp) / name, k)
            proc, address = serve(root, "udp://127.0.0.1:0")
            try:
                for delay in delays:
                    with Relay(address, Impairment(delay_s=delay, jitter_s=jitter), seed=2) as relay:
                        cfg = HilSuiteConfig(devices=(relay.address,), episodes=episodes, max_steps=steps,
                                             scenarios=("nominal",))
                        report = hil_evaluate(cfg, HilGateConfig(), onnx, "cartpole")
                    base, hil = report.scenarios[0]["in_process"], report.scenarios[0]["hil"]
                    failed = [short for key, short in CLAUSES.items()
                              for c in report.checks if key in c.name and not c.passed]
                    print(f"| {name} | {delay * 1e3:g} | {base['mean_return']:.1f} | {hil['mean_return']:.1f} | "
                          f"{hil['falls']}/{hil['episodes']} | {report.round_trip_ms_p99:.1f} | "
                          f"{hil['deadline_misses']}/{hil['steps']} | "
                          f"{'FAIL: ' + ', '.join(failed) if failed else 'pass'} |", flush=True)
            finally:
                stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=sorted(POLICIES), default="balancer",
                    help="tests/test_evaluate.py's balancer or its latency-fragile one")
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--delay", type=float, default=0.0, help="relay one-way delay (s); 0 with no jitter/loss: direct")
    ap.add_argument("--jitter", type=float, default=0.0)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--sweep", type=lambda v: [float(d) for d in v.split(",")], default=None,
                    help="comma-separated one-way delays (s): both policies' HIL gate at each, a table")
    args = ap.parse_args()
    if args.sweep is not None:
        sweep(args.sweep, args.jitter, args.episodes, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root, onnx = cartpole_store(Path(tmp), POLICIES[args.policy])
        proc, address = serve(root, "udp://127.0.0.1:0")
        try:
            shaped = args.delay or args.jitter or args.loss
            link = Impairment(delay_s=args.delay, jitter_s=args.jitter, loss=args.loss)
            with (Relay(address, link) if shaped else contextlib.nullcontext()) as relay:
                r = run_hil(HilConfig(device=relay.address if shaped else address, episodes=args.episodes,
                                      max_steps=args.steps), "cartpole")
        finally:
            stop(proc)
        local = in_process_ms(onnx)
        task = hil_task("cartpole", args.steps)
        expected = run_episodes(OnnxRuntime(onnx), twin_env(task, Scenario(name="nominal"), task.nominal_params(),
                                                             1000, args.episodes))
    rtt = r.rtt_ms()
    periods = sum(e.steps for e in r.episodes)
    print(f"link: {'relay ' + link.model_dump_json() if shaped else 'loopback, direct'}; period {r.period_s * 1e3:g} ms, "
          f"{len(r.episodes)} episodes, {periods} periods")
    print(f"HIL round trip     p50 {rtt['p50']:.3f} ms  p99 {rtt['p99']:.3f} ms  max {rtt['max']:.3f} ms")
    print(f"in-process infer   p50 {np.percentile(local, 50):.4f} ms  p99 {np.percentile(local, 99):.4f} ms")
    print(f"ratio HIL/in-process  p50 {rtt['p50'] / np.percentile(local, 50):.0f}x  "
          f"p99 {rtt['p99'] / np.percentile(local, 99):.0f}x")
    print(f"deadline misses {r.total('deadline_misses')} ({r.total('late_actions')} late, {r.total('lost_actions')} lost), "
          f"host overruns {r.total('host_overruns')}, device LATE flags {r.total('device_late')}; "
          f"falls {sum(e.fell for e in r.episodes)}")
    print(f"returns HIL {np.round(r.returns, 2).tolist()}, in-process {np.round(expected.returns, 2).tolist()} "
          f"(falls {int(expected.fell.sum())}); same seeds")
    if shaped:
        print(f"relay: up {relay.counters['up']}, down {relay.counters['down']}")


if __name__ == "__main__":
    main()
