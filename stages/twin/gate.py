"""Gates are config: floors the evaluation must clear, per scenario, before a policy may become champion.

Floors apply to interval lower bounds, so a handful of lucky episodes cannot pass; limits on a task's own
metrics (:class:`stages.sim.task.Metric`) apply to the bound on the worse side of their interval. Safety ceilings
and the latency budget apply to the whole suite; non-inferiority to the champion is a paired
comparison on the same seeds across the suite.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from stages.sim.task import Metric, Task


class GateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    min_success_rate: float = Field(0.8, ge=0, le=1, description="Default floor on the lower bound of each scenario's "
                                    "success-rate Wilson 95% interval (a scenario may set its own).")
    min_mean_return: Optional[float] = Field(None, description="Default floor on the lower bound of each scenario's "
                                             "mean-return 95% bootstrap interval (None: no floor unless the scenario sets one).")
    metric_limits: dict[str, float] = Field(
        default_factory=dict, description="Default limit per task metric (by name) on each scenario's 95% bootstrap "
        "interval: its upper bound must stay at or below it when lower is better, its lower bound at or above it when "
        "higher is (a scenario may set its own).")
    max_nan_actions: int = Field(0, ge=0, description="Ceiling on control steps with a NaN/Inf action, whole suite.")
    max_joint_limit_fraction: float = Field(0.1, ge=0, le=1, description="Ceiling on the fraction of control steps "
                                            "with a robot joint at its range limit, whole suite.")
    max_saturation_fraction: float = Field(0.95, ge=0, le=1, description="Ceiling on the fraction of action "
                                           "components at the actuator limit, whole suite.")
    max_latency_fraction: float = Field(1.0, gt=0, description="In-loop inference latency p99 must stay below this "
                                        "fraction of the control period.")
    non_inferiority_margin: float = Field(
        10.0, ge=0, description="Against the champion on the same seeds: the lower 95% bound of the mean paired "
                                "return difference (challenger − champion) over the suite must be at least −margin.")


class Check(BaseModel):
    """One line of the gate table."""

    model_config = ConfigDict(frozen=True)
    name: str
    passed: bool
    detail: str

    def reason(self) -> str:
        return f"{'pass' if self.passed else 'FAIL'}: {self.name} {self.detail}"


def floor_checks(scenario: str, success_low: float, success_floor: float, return_low: float,
                 return_floor: Optional[float]) -> list[Check]:
    checks = [Check(name=f"{scenario}: success rate lower 95% bound", passed=success_low >= success_floor,
                    detail=f"{success_low:.3f} >= {success_floor}")]
    if return_floor is not None:
        checks.append(Check(name=f"{scenario}: mean return lower 95% bound", passed=return_low >= return_floor,
                            detail=f"{return_low:.1f} >= {return_floor}"))
    return checks


def check_metric_names(names: Iterable[str], task: Task) -> None:
    """Refuse, in one line, a gate limit on a metric the task does not declare."""
    known = [m.name for m in task.metrics]
    for name in names:
        if name not in known:
            raise ValueError(f"gate metric limit {name!r}: task {task.name!r} has no such metric (its metrics: "
                             f"{known or 'none'})")


def metric_checks(scenario: str, metrics: Sequence[Metric], ci95: Mapping[str, Sequence[float]],
                  limits: Mapping[str, float]) -> list[Check]:
    """Each limited metric's conservative bound: the upper one is a ceiling's, the lower one a floor's."""
    checks = []
    for m in (m for m in metrics if m.name in limits):
        limit, (low, high) = limits[m.name], ci95[m.name]
        if m.better == "lower":
            checks.append(Check(name=f"{scenario}: {m.name} upper 95% bound", passed=high <= limit,
                                detail=f"{high:.3f} <= {limit} {m.unit}"))
        else:
            checks.append(Check(name=f"{scenario}: {m.name} lower 95% bound", passed=low >= limit,
                                detail=f"{low:.3f} >= {limit} {m.unit}"))
    return checks


def suite_checks(gate: GateConfig, nan_actions: int, limit_fraction: float, saturation: float, latency_p99_ms: float,
                 period_s: float, paired_low: Optional[float]) -> list[Check]:
    """Safety ceilings, the latency budget and (with a champion) non-inferiority."""
    budget_ms = gate.max_latency_fraction * period_s * 1e3
    checks = [
        Check(name="NaN/Inf actions", passed=nan_actions <= gate.max_nan_actions, detail=f"{nan_actions} <= {gate.max_nan_actions}"),
        Check(name="steps at a joint limit", passed=limit_fraction <= gate.max_joint_limit_fraction,
              detail=f"{limit_fraction:.3f} <= {gate.max_joint_limit_fraction}"),
        Check(name="actuator saturation", passed=saturation <= gate.max_saturation_fraction,
              detail=f"{saturation:.3f} <= {gate.max_saturation_fraction}"),
        Check(name="in-loop latency p99", passed=latency_p99_ms < budget_ms, detail=f"{latency_p99_ms:.3f} ms < {budget_ms:.1f} ms"),
    ]
    if paired_low is not None:
        checks.append(Check(name="vs champion, paired return difference lower 95% bound",
                            passed=paired_low >= -gate.non_inferiority_margin,
                            detail=f"{paired_low:.1f} >= -{gate.non_inferiority_margin}"))
    return checks
