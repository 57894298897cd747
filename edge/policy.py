"""The on-device policy API: ``Policy.load(root).act(obs)``, with the bundle's I/O contract enforced.

Observation and action names, order and limits come from the manifest; nothing is hard-coded.
Non-finite observations or actions yield the safe default action and are counted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from edge.runtime import select_runtime
from edge.store import DeviceStore


class Policy:
    def __init__(self, bundle_dir: Path, manifest: dict, engines_dir: Optional[Path] = None) -> None:
        io = manifest["io"]
        self.manifest = manifest
        self.obs_names = [t["name"] for t in io["input"]["terms"]]
        self.command_names = [t["name"] for t in io["input"]["terms"] if t.get("source") == "command"]
        self.action_names = [t["name"] for t in io["output"]["terms"]]
        self.low = np.asarray(io["output"]["low"], dtype=np.float32)
        self.high = np.asarray(io["output"]["high"], dtype=np.float32)
        self.default = np.asarray(io["output"]["default"], dtype=np.float32)
        self.period_s = float(manifest["control"]["period_s"])
        selection = select_runtime(bundle_dir / "policy.onnx", manifest, engines_dir)  # TensorRT → ORT CUDA → ORT CPU
        self.runtime, self.runtime_description = selection.runtime, selection.describe()
        self.unsafe_count = 0
        self.n_obs = len(self.obs_names)
        self._input = self.runtime.input_name
        if getattr(self.runtime, "compiled_run", False):
            self._run, self._bound = self.runtime._run, self._bind()
        else:
            self._run, self._bound = (lambda feeds: [self.runtime.run(feeds[self._input])]), None

    @property
    def io_bound(self) -> bool:
        """Whether single observations run through buffers bound once (the CPU provider's fast path)."""
        return self._bound is not None

    def _bind(self):
        """For single observations on the CPU provider: input and output bound once to preallocated buffers
        (IO binding), so a call copies the observation in and runs, with no per-call tensor allocation.
        Returns (input row, output row, run) or None where this ONNX Runtime lacks the calls."""
        session = self.runtime.session
        x = np.zeros((1, self.n_obs), np.float32)
        y = np.zeros((1, len(self.action_names)), np.float32)
        try:
            binding = session.io_binding()
            binding.bind_input(self._input, "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
            binding.bind_output(self.runtime.output_name, "cpu", 0, np.float32, list(y.shape), y.ctypes.data)
            compiled, raw = session._sess, binding._iobinding
            run = lambda: compiled.run_with_iobinding(raw, None)  # noqa: E731
        except (AttributeError, TypeError, RuntimeError):
            return None
        self._buffers = (x, y, binding)  # keep them alive: the session holds raw pointers into x and y
        return x[0], y[0], run

    @classmethod
    def load(cls, root: Path) -> "Policy":
        """The active policy of the device store at ``root``."""
        store = DeviceStore(root)
        current = store.link("current")
        if current is None:
            raise FileNotFoundError(f"no active policy in {root}")
        return cls(current, json.loads((current / "manifest.json").read_text()), store.engines_dir)

    def check_names(self, names: Sequence[str]) -> None:
        """Refuse an observation layout that differs from the bundle's."""
        if list(names) != self.obs_names:
            raise ValueError(f"observation names {list(names)} do not match the bundle's {self.obs_names}")

    def act(self, obs: np.ndarray) -> np.ndarray:
        """(obs_dim,) or (B, obs_dim) observations → actions clamped to the manifest's limits.

        Not thread-safe: a single observation goes through buffers shared by every call."""
        bound = self._bound
        if bound is not None and type(obs) is np.ndarray and obs.shape == (self.n_obs,):
            x, y, run = bound
            x[:] = obs
            if math.isfinite(x.dot(x)):  # else (NaN/Inf, or a dot-product overflow) the exact path below
                run()
                if math.isfinite(y.dot(y)):
                    return np.minimum(np.maximum(y, self.low), self.high)
        return self._act(obs)

    def _act(self, obs: np.ndarray) -> np.ndarray:
        x = obs if type(obs) is np.ndarray and obs.dtype == np.float32 else np.asarray(obs, dtype=np.float32)
        single = x.ndim == 1
        batch = x[None] if single else x
        if batch.shape[1] != self.n_obs:
            raise ValueError(f"observation has {batch.shape[1]} values, the bundle expects {self.n_obs} "
                             f"({', '.join(self.obs_names)})")
        # fast finiteness test: a dot product is NaN/Inf if any element is (or if it overflows, a false
        # alarm that the exact per-row test below sorts out); one BLAS call instead of isfinite + all
        flat = x if single else x.reshape(-1)
        finite_in = math.isfinite(flat.dot(flat))
        out = self._run({self._input: batch if finite_in else np.nan_to_num(batch, nan=0.0, posinf=0.0, neginf=0.0)})[0]
        o = out[0] if single else out.reshape(-1)
        if not (finite_in and math.isfinite(o.dot(o))):
            # rare path: rows with a non-finite observation or action get the safe default
            safe = np.isfinite(batch).all(axis=1) & np.isfinite(out).all(axis=1)
            self.unsafe_count += int((~safe).sum())
            out[~safe] = self.default
        np.minimum(np.maximum(out, self.low, out=out), self.high, out=out)
        return out[0] if single else out
