"""Gates are config: floors the evaluation must clear before a policy may become champion."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    min_success_rate: float = Field(0.8, ge=0, le=1, description="Floor on the twin's success rate.")
    min_mean_return: float = Field(150.0, description="Floor on the mean episode return.")
    max_nan_actions: int = Field(0, ge=0, description="Ceiling on non-finite actions.")


def decide(gate: GateConfig, success_rate: float, mean_return: float, nan_actions: int) -> tuple[bool, tuple[str, ...]]:
    """(passed, reasons): one reason per floor or ceiling, saying pass or fail and the numbers."""
    checks = (
        ("success rate", success_rate >= gate.min_success_rate, f"{success_rate:.3f} >= {gate.min_success_rate}"),
        ("mean return", mean_return >= gate.min_mean_return, f"{mean_return:.1f} >= {gate.min_mean_return}"),
        ("NaN actions", nan_actions <= gate.max_nan_actions, f"{nan_actions} <= {gate.max_nan_actions}"),
    )
    reasons = tuple(f"{'pass' if ok else 'FAIL'}: {name} {text}" for name, ok, text in checks)
    return all(ok for _, ok, _ in checks), reasons
