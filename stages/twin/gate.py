"""Gates are config: floors the evaluation must clear before a policy may become champion."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    min_success_rate: float = Field(0.8, ge=0, le=1,
                                    description="Floor on the lower bound of the success rate's Wilson 95% interval.")
    min_mean_return: float = Field(150.0, description="Floor on the lower bound of the mean return's 95% bootstrap interval.")
    max_nan_actions: int = Field(0, ge=0, description="Ceiling on non-finite actions.")
    non_inferiority_margin: float = Field(
        10.0, ge=0, description="Against the champion on the same seeds: the lower 95% bound of the mean paired "
                                "return difference (challenger − champion) must be at least −margin.")


def decide(gate: GateConfig, success_low: float, return_low: float, nan_actions: int,
           paired_low: float | None = None) -> tuple[bool, tuple[str, ...]]:
    """(passed, reasons): one reason per floor or ceiling, saying pass or fail and the numbers.

    Floors apply to the lower bounds of the intervals, so a handful of lucky episodes cannot pass.
    ``paired_low`` is the lower bound of the paired difference to the champion (None: no champion).
    """
    checks = [
        ("success rate lower 95% bound", success_low >= gate.min_success_rate, f"{success_low:.3f} >= {gate.min_success_rate}"),
        ("mean return lower 95% bound", return_low >= gate.min_mean_return, f"{return_low:.1f} >= {gate.min_mean_return}"),
        ("NaN actions", nan_actions <= gate.max_nan_actions, f"{nan_actions} <= {gate.max_nan_actions}"),
    ]
    if paired_low is not None:
        checks.append(("vs champion, paired return difference lower 95% bound", paired_low >= -gate.non_inferiority_margin,
                       f"{paired_low:.1f} >= -{gate.non_inferiority_margin}"))
    reasons = tuple(f"{'pass' if ok else 'FAIL'}: {name} {text}" for name, ok, text in checks)
    return all(ok for _, ok, _ in checks), reasons
