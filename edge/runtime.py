"""Inference runtimes behind one interface. ONNX Runtime here; TensorRT where it is installed."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import numpy as np


class OnnxRuntime:
    """ONNX Runtime session with one float32 input and one output, single-threaded by default."""

    name = "onnxruntime"

    def __init__(self, onnx_path: Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int = 1) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        available = set(ort.get_available_providers())
        chosen: List[str] = [p for p in providers if p in available] or ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=chosen)
        self.providers = self.session.get_providers()
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        # InferenceSession.run is a Python wrapper (feed-name validation, EP-failure fallback) around the
        # compiled session's run; on the CPU provider alone, where no fallback applies and act() checks the
        # input's shape itself, call the compiled run directly (~3 us less per call); else the public one.
        compiled = getattr(self.session, "_sess", None)
        if self.providers == ["CPUExecutionProvider"] and compiled is not None and hasattr(compiled, "run"):
            self._run = lambda feeds: compiled.run([self.output_name], feeds, None)
        else:
            self._run = lambda feeds: self.session.run([self.output_name], feeds)
        self.compiled_run = self.providers == ["CPUExecutionProvider"] and compiled is not None

    def run(self, obs: np.ndarray) -> np.ndarray:
        """(B, obs_dim) float32 → (B, act_dim) float32."""
        return self._run({self.input_name: obs})[0]
