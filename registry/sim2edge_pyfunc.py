"""The registered policy's ``python_function`` loader: what a Python user passes, checked and cast, then the onnx flavor.

Shipped inside every registered model (its ``code/`` folder) and imported there by stock MLflow, so it needs
nothing but MLflow, NumPy, pandas and PyYAML. Inputs:

- a DataFrame (or a dict of columns) whose columns are the observation terms, matched by name in any order;
  extra columns are ignored, a missing term is refused naming the missing and the extra columns;
- an array, a list of rows, or a DataFrame without column names: one column per term, in the policy's order
  (one row may be given flat).

Values may be float, int or bool. They are cast to the graph's float32 as the device runtime casts them; an
int beyond 2**24 (which float32 no longer holds exactly), a value that is not finite once cast, or a column
that is not numeric is refused in one line naming the column.
"""

from __future__ import annotations

from pathlib import Path

import mlflow.onnx
import numpy as np
import pandas as pd
import yaml
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

EXACT_INT = 2 ** 24


def _load_pyfunc(data_path: str) -> "PolicyPyfunc":
    """MLflow's loader hook: the onnx flavor's pyfunc for the graph, fed by the terms in the model's metadata."""
    mlmodel = yaml.safe_load((Path(data_path).parent / "MLmodel").read_text())
    terms = [t["name"] for t in mlmodel["metadata"]["sim2edge.observations"]]
    return PolicyPyfunc(mlflow.onnx._load_pyfunc(data_path), terms)


def refused(message: str) -> MlflowException:
    return MlflowException(f"policy input: {message}", error_code=INVALID_PARAMETER_VALUE)


class PolicyPyfunc:
    """The onnx flavor's pyfunc behind a check that turns any usual Python input into float32 term columns."""

    def __init__(self, onnx_pyfunc, terms: list[str]):
        self.onnx_pyfunc, self.terms = onnx_pyfunc, terms

    def predict(self, data, params=None) -> pd.DataFrame:
        return self.onnx_pyfunc.predict(self.frame(data), params)

    def frame(self, data) -> pd.DataFrame:
        """``data`` as one float32 column per term, in the policy's order."""
        if isinstance(data, dict):
            data = pd.DataFrame(data)
        if isinstance(data, pd.DataFrame) and all(isinstance(c, str) for c in data.columns) and len(data.columns):
            missing = [t for t in self.terms if t not in data.columns]
            if missing:
                extra = [c for c in data.columns if c not in self.terms]
                raise refused(f"missing terms {missing}" + (f", extra columns {extra}" if extra else "")
                              + f"; the terms are {self.terms}")
            return pd.DataFrame({t: as_float32(t, data[t].to_numpy()) for t in self.terms})
        values = np.asarray(data.to_numpy() if isinstance(data, pd.DataFrame) else data)
        if values.ndim == 1:
            values = values[None, :]
        if values.ndim != 2 or values.shape[1] != len(self.terms):
            raise refused(f"an array of shape {values.shape} given; it needs one column per term, "
                          f"(rows, {len(self.terms)}), in the order {self.terms}")
        return pd.DataFrame({t: as_float32(t, values[:, i]) for i, t in enumerate(self.terms)})


def as_float32(name: str, values: np.ndarray) -> np.ndarray:
    """One term's column as float32, refused where the cast would change an int or the value is not finite."""
    if values.dtype == object:
        try:
            values = pd.to_numeric(pd.Series(values), errors="raise").to_numpy()
        except (TypeError, ValueError):
            raise refused(f"column {name!r} is not numeric (first value {values[0]!r})") from None
    if values.dtype.kind not in "biuf":
        raise refused(f"column {name!r} has dtype {values.dtype}, not a number")
    if values.dtype.kind in "iu" and values.size and np.abs(values.astype(np.float64)).max() > EXACT_INT:
        raise refused(f"column {name!r} holds {values[np.abs(values.astype(np.float64)).argmax()]}, "
                      f"beyond the integers float32 holds exactly (2**24)")
    cast = values.astype(np.float32)
    bad = ~np.isfinite(cast)
    if bad.any():
        raise refused(f"column {name!r} row {int(np.argmax(bad))} is {values[np.argmax(bad)]}, not a finite float32")
    return cast
