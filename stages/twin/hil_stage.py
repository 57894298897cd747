"""The pipeline's ``hil_evaluate`` stage: the packaged bundle on a device, the suite in-process vs HIL, gated.

Between ``package`` and ``register``. With ``device: local`` the stage is its own bench device: it
installs the signed bundle into a fresh device store (verified against the workspace's key) and
serves it with ``sim2edge-agent run`` on loopback for the stage's duration. With an address, the
device there must serve the candidate bundle already (a Jetson on the bench; the graph it reports is checked
against the bundle's); with a list of
addresses, the suite is sharded across those devices (``hil_evaluate.run_shards``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.sim.params import PhysicalParams
from stages.twin.hil_evaluate import HilReport, HilSuiteConfig, check_devices, hil_evaluate, load_gate

LOCAL = "local"
MAX_BUNDLE_BYTES = 1 << 30


class HilSettings(BaseModel):
    """Hardware-in-the-loop evaluation of the packaged candidate (pipeline parameter ``hil``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: Union[str, tuple[str, ...]] = Field(
        description="`local` (the stage serves the bundle with sim2edge-agent run on loopback), the address of a "
                    "device serving it (udp://HOST:PORT or unix:///PATH), or a list of such addresses to shard the "
                    "suite across.")
    gate_file: Optional[Path] = Field(None, description="YAML of the HIL gate's floors (None: the defaults).")
    episodes: int = Field(2, ge=1, description="Real-time episodes per scenario.")
    max_steps: Optional[int] = Field(None, ge=1, description="Control steps per episode (None: the task's).")
    scenarios: tuple[str, ...] = Field(("nominal",), description="Scenarios of the suite to run (empty: all).")
    dead_after_periods: int = HilSuiteConfig.model_fields["dead_after_periods"]

    @field_validator("device")
    @classmethod
    def _device(cls, device: Union[str, tuple[str, ...]]) -> Union[str, tuple[str, ...]]:
        if device == ():
            raise ValueError(f"give at least one device address, or {LOCAL!r}")
        if device != LOCAL:
            try:
                check_devices((device,) if isinstance(device, str) else device)
            except ValueError as e:
                raise ValueError(str(e) if isinstance(device, tuple) else f"{e}, or {LOCAL!r}") from None
        return device

    @property
    def devices(self) -> tuple[str, ...]:
        """The addresses (``local``: none yet, the bench agent's comes when it serves)."""
        return () if self.device == LOCAL else (self.device,) if isinstance(self.device, str) else self.device

    def suite(self, devices: tuple[str, ...], seed: int) -> HilSuiteConfig:
        return HilSuiteConfig(devices=devices, episodes=self.episodes, seed=seed, max_steps=self.max_steps,
                              scenarios=self.scenarios, dead_after_periods=self.dead_after_periods)


@contextmanager
def bench_device(bundle: Path, trusted: Path, root: Path) -> Iterator[str]:
    """Install ``bundle`` (verified against ``trusted``) in a device store at ``root`` and serve it on loopback with
    ``sim2edge-agent run``; yields its address and stops the agent after."""
    from edge import bundle as bundles, signing
    from edge.store import DeviceStore

    store = DeviceStore(root)
    staged = store.staging_dir()
    manifest = bundles.extract(bundle, staged, MAX_BUNDLE_BYTES, signing.load_trusted([trusted]))
    m = manifest["policy"]
    store.activate(store.install(staged, m["name"], str(m["version"])))
    # the watchdog out of the way: between episodes the host is silent, and every action should answer an observation
    proc = subprocess.Popen([sys.executable, "-m", "edge.cli", "run", "--root", str(root), "--listen",
                             "udp://127.0.0.1:0", "--watchdog-periods", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("serving "):
            proc.kill()
            raise RuntimeError(f"the bench agent did not start: {line.strip()} {proc.communicate(timeout=10)[1].strip()}")
        yield line.split(" on ", 1)[1].split(" ")[0]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=10)


def run_hil_stage(cfg: HilSettings, bundle: Path, trusted: Path, onnx: Path, task_ref: str, params: PhysicalParams,
                  seed: int, workdir: Path) -> HilReport:
    """The HIL suite of ``cfg`` against the candidate: on a bench agent (``local``) or on the devices at their
    addresses."""
    gate, graph = load_gate(cfg.gate_file), bundled_graph(bundle)
    if cfg.device != LOCAL:
        return hil_evaluate(cfg.suite(cfg.devices, seed), gate, onnx, task_ref, params, graph)
    with bench_device(bundle, trusted, workdir / "device") as address:
        return hil_evaluate(cfg.suite((address,), seed), gate, onnx, task_ref, params, graph)


def bundled_graph(bundle: Path) -> str:
    """The sha256 of the bundle's ``policy.onnx`` as its manifest lists it: what a device serving it reports."""
    from edge import bundle as bundles

    with tarfile.open(bundle) as tar:
        return json.loads(tar.extractfile(bundles.MANIFEST).read())["files"]["policy.onnx"]["sha256"]


def hil_metrics(report: HilReport) -> dict[str, float]:
    """Per scenario ``hil.<scenario>.<name>`` (success, return, deadline misses, late, lost, RTT p50/p99/max, and
    in-process success and return beside them); the suite's RTT p99 and the verdict."""
    out = {"hil.round_trip_ms_p99": report.round_trip_ms_p99, "hil.gate_passed": float(report.passed),
           "hil.paired_difference_low": report.paired_difference_ci95[0]}
    for r in report.scenarios:
        hil, base, key = r["hil"], r["in_process"], f"hil.{r['scenario']}"
        out.update({f"{key}.{k}": float(hil[k]) for k in (
            "success_rate", "mean_return", "deadline_misses", "deadline_miss_fraction", "late_actions",
            "lost_actions", "rtt_ms_p50", "rtt_ms_p99", "rtt_ms_max", "falls")})
        out.update({f"{key}.in_process_success_rate": base["success_rate"],
                    f"{key}.in_process_mean_return": base["mean_return"]})
    return out


def failed_clauses(report: HilReport) -> str:
    """Why a version is not promoted: the failing HIL clauses, one line."""
    return "HIL gate failed: " + "; ".join(f"{c.name} ({c.detail})" for c in report.checks if not c.passed)
