"""The scenario suite over hardware-in-the-loop, beside in-process evaluation on the same seeds, gated.

Every scenario runs twice on the same initial states (one shard, seed ``cfg.seed``): in-process,
through ``edge.runtime`` as evaluation does, and in real time against the device (``run_hil``). The
HIL gate adds floors on what only the link and the device can do wrong: deadline misses per
scenario, the round-trip p99 against a fraction of the control period, and HIL returns
non-inferior to in-process returns (the paired per-episode difference over the suite). A
scenario's ``extra_latency_steps`` applies in-process only: over HIL the link is the latency.

The pipeline's ``hil_evaluate`` stage (``stages.twin.hil_stage``) runs it on the packaged bundle
after ``package`` when ``hil`` is set in its parameters; a failing HIL gate keeps the version a challenger.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge.runtime import OnnxRuntime
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.twin.episodes import run_episodes
from stages.twin.gate import Check
from stages.twin.hil import HilConfig, HilResult, hil_task, run_hil
from stages.twin.hil_link import parse_address
from stages.twin.stats import bootstrap_mean, wilson
from stages.twin.suite import Scenario, load_suite, suite_path


class HilGateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_deadline_miss_fraction: float = Field(0.05, ge=0, le=1, description="Ceiling, per scenario, on the fraction "
                                              "of control periods whose action had not arrived when the period ended.")
    max_round_trip_fraction: float = Field(1.0, gt=0, description="The round-trip p99 over the suite must stay "
                                           "below this fraction of the control period (the round trip includes the "
                                           "wait for the device's tick, HilConfig.lead of a period).")
    return_margin: float = Field(10.0, ge=0, description="HIL against in-process on the same seeds: the lower 95% "
                                 "bound of the mean paired return difference (HIL − in-process) must be ≥ −margin.")


def load_gate(path: Optional[Path]) -> HilGateConfig:
    """The HIL gate of a YAML file of HilGateConfig's keys (None: the defaults); ValueError in one line naming it."""
    if path is None:
        return HilGateConfig()
    try:
        return HilGateConfig(**(yaml.safe_load(path.read_text()) or {}))
    except (OSError, yaml.YAMLError, TypeError) as e:
        raise ValueError(f"HIL gate {path}: {str(e).splitlines()[0]}") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"HIL gate {path}: {'.'.join(map(str, err['loc']))}: {err['msg']} "
                         f"(allowed: {', '.join(HilGateConfig.model_fields)})") from None


class HilSuiteConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str = Field(description="The device's address: udp://HOST:PORT or unix:///PATH.")
    episodes: int = Field(4, ge=1, description="Seeded episodes per scenario (real time: each lasts its task's "
                                               "episode length).")
    seed: int = Field(1000, description="Seed of initial states, as in EvalConfig (one shard).")
    max_steps: Optional[int] = Field(None, ge=1, description="Control steps per episode (None: the task's).")
    suite: Optional[Path] = Field(None, description="Scenario suite file (None: the task's own, else the default).")
    scenarios: tuple[str, ...] = Field((), description="Run only these scenarios of the suite (empty: all).")

    @field_validator("device")
    @classmethod
    def _address(cls, device: str) -> str:
        parse_address(device)
        return device

    def select(self, task_ref: str) -> tuple[Scenario, ...]:
        """The suite's scenarios to run; an unknown name raises ValueError naming it and the suite's."""
        suite = load_suite(self.suite or suite_path(hil_task(task_ref).name))
        names = [s.name for s in suite.scenarios]
        unknown = [n for n in self.scenarios if n not in names]
        if unknown:
            raise ValueError(f"scenario {unknown[0]!r} is not in the suite ({', '.join(names)})")
        return tuple(s for s in suite.scenarios if not self.scenarios or s.name in self.scenarios)


class HilReport(BaseModel):
    """Per scenario the in-process and HIL rows side by side; the HIL gate's clauses."""

    model_config = ConfigDict(frozen=True)
    task: str
    device: str
    seed: int
    period_s: float
    scenarios: tuple[dict, ...]
    round_trip_ms_p99: float
    paired_difference_ci95: tuple[float, float]
    gate: HilGateConfig
    checks: tuple[Check, ...]
    device_runtime: Optional[str] = Field(None, description="The runtime the device chose, e.g. 'onnxruntime "
                                          "(CPUExecutionProvider)', from its statistics (None: it did not say).")

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({**self.model_dump(mode="json"), "passed": self.passed}, indent=2)


def in_process(onnx: Path, task_ref: str, scenario: Scenario, params: PhysicalParams, cfg: HilSuiteConfig) -> dict:
    """``cfg.episodes`` of ``scenario`` through the device runtime code, in-process, on the HIL episodes' seeds."""
    env = BatchedEnv(hil_task(task_ref, cfg.max_steps), cfg.episodes, params=scenario.params(params), seed=cfg.seed,
                     disturbance=scenario.disturbance)
    e = run_episodes(OnnxRuntime(onnx), env)
    return {"returns": e.returns.tolist(), "success_rate": float(e.success.mean()),
            "success_rate_ci95": list(wilson(int(e.success.sum()), len(e.success))),
            "mean_return": float(e.returns.mean()), "mean_return_ci95": list(bootstrap_mean(e.returns, seed=cfg.seed)),
            "falls": int(e.fell.sum())}


def device_counters(r: HilResult) -> Optional[dict]:
    """How much each of the device's counters grew during the scenario, and its act() timing after it."""
    if r.device_before is None or r.device_after is None:
        return None
    grown = {k: r.device_delta(k) for k, v in r.device_after.items() if isinstance(v, int) and not isinstance(v, bool)}
    return {**grown, **{k: r.device_after[k] for k in ("act_p50_us", "act_p99_us", "wake_late_p99_us")}}


def device_runtime(r: HilResult) -> Optional[str]:
    """The runtime serving on the device and its providers, as its statistics (S2S1) name them."""
    stats = r.device_after or r.device_before or {}
    if "runtime" not in stats:
        return None
    return f"{stats['runtime']} ({', '.join(stats.get('providers', []))})"


def hil_checks(gate: HilGateConfig, rows: list[dict], rtt_p99_ms: float, period_s: float,
               paired_low: float) -> list[Check]:
    """Deadline misses per scenario; the round-trip budget and paired non-inferiority over the suite."""
    checks = [Check(name=f"{r['scenario']}: HIL deadline-miss fraction",
                    passed=r["hil"]["deadline_miss_fraction"] <= gate.max_deadline_miss_fraction,
                    detail=f"{r['hil']['deadline_miss_fraction']:.3f} <= {gate.max_deadline_miss_fraction}")
              for r in rows]
    budget_ms = gate.max_round_trip_fraction * period_s * 1e3
    checks.append(Check(name="HIL round-trip p99", passed=rtt_p99_ms < budget_ms,
                        detail=f"{rtt_p99_ms:.1f} ms < {budget_ms:.1f} ms"))
    checks.append(Check(name="HIL vs in-process paired return difference lower 95% bound",
                        passed=paired_low >= -gate.return_margin, detail=f"{paired_low:.1f} >= -{gate.return_margin}"))
    return checks


def hil_evaluate(cfg: HilSuiteConfig, gate: HilGateConfig, onnx: Path, task_ref: str,
                 params: Optional[PhysicalParams] = None) -> HilReport:
    """Each selected scenario in-process and over HIL on the same seeds; the HIL gate over the results."""
    task = hil_task(task_ref, cfg.max_steps)
    params = params or task.nominal_params()
    rows, diffs, rtts, runtime = [], [], [], None
    for sc in cfg.select(task_ref):
        base = in_process(onnx, task_ref, sc, params, cfg)
        hil = run_hil(HilConfig(device=cfg.device, episodes=cfg.episodes, seed=cfg.seed, max_steps=cfg.max_steps),
                      task_ref, sc, params)
        row = hil.summary(cfg.seed)
        row["deadline_miss_fraction"] = row["deadline_misses"] / max(sum(e.steps for e in hil.episodes), 1)
        diffs.append(hil.returns - np.asarray(base.pop("returns")))
        rtts += [t for e in hil.episodes for t in e.rtt_ms]
        rows.append({"scenario": sc.name, "in_process": base, "hil": row, "device": device_counters(hil)})
        runtime = runtime or device_runtime(hil)
    paired = bootstrap_mean(np.concatenate(diffs), seed=cfg.seed)
    rtt_p99 = float(np.percentile(rtts, 99)) if rtts else math.nan
    return HilReport(task=task.name, device=cfg.device, seed=cfg.seed, period_s=task.ctrl_dt, scenarios=tuple(rows),
                     round_trip_ms_p99=rtt_p99, paired_difference_ci95=tuple(paired), gate=gate,
                     checks=tuple(hil_checks(gate, rows, rtt_p99, task.ctrl_dt, paired[0])), device_runtime=runtime)
