"""A time-to-target learning curve for the benchmarks that race learners: training seconds with the evaluations'
time left out, one row ``(train_s, env_steps, *scores)`` per evaluation, rewritten as CSV after each."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Callable


class Curve:
    """Rows of evaluations; ``hit(row)`` says whether a row reached the target."""

    def __init__(self, path: Path, scores: tuple[str, ...], hit: Callable[[tuple], bool]) -> None:
        self.path, self.header, self.hit, self.rows = path, ("train_s", "env_steps", *scores), hit, []
        self.start, self.eval_s = time.perf_counter(), 0.0

    def train_s(self) -> float:
        return time.perf_counter() - self.start - self.eval_s

    def add(self, train_s: float, env_steps: int, *scores: float) -> None:
        self.rows.append((train_s, env_steps, *scores))
        with self.path.open("w", newline="") as f:
            csv.writer(f).writerows([self.header, *self.rows])

    def evaluate(self, env_steps: int, score: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
        """Run ``score`` now, its time left out of the training seconds, and add its row."""
        t, start = self.train_s(), time.perf_counter()
        scores = score()
        self.eval_s += time.perf_counter() - start
        self.add(t, env_steps, *scores)
        return scores

    @property
    def crossed(self) -> tuple[float, int] | None:
        """(training seconds, env steps) at the first evaluation that reached the target."""
        return next(((row[0], row[1]) for row in self.rows if self.hit(row)), None)

    @property
    def reached(self) -> tuple[float, int]:
        """(training seconds, env steps) at the crossing, or at the last evaluation without one."""
        return self.crossed or (self.rows[-1][:2] if self.rows else (self.train_s(), 0))

    def shown(self) -> str:
        return f"{'' if self.crossed else '>'}{self.reached[0]:.1f}"
