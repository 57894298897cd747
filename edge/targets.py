"""Jetson target profiles (data, from JETSON.md) and detection of the device this runs on."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

from edge.errors import CheckFailed


@dataclass(frozen=True)
class TargetProfile:
    """What a bundle is built for. L4T range is inclusive-exclusive: [l4t_min, l4t_max)."""

    name: str
    module: str
    jetpack: str
    l4t_min: Tuple[int, ...]
    l4t_max: Tuple[int, ...]
    arch: str
    cuda: str
    tensorrt: str
    gpu_sm: str
    max_opset: int
    dla_cores: int
    python: str
    base_images: Tuple[str, ...] = field(default_factory=tuple)
    onnxruntime_index: str = ""  # pip index with onnxruntime-gpu for this JetPack (Jetson AI Lab); "": PyPI's CPU build

    def to_dict(self) -> dict:
        d = asdict(self)
        d["l4t_min"], d["l4t_max"] = ".".join(map(str, self.l4t_min)), ".".join(map(str, self.l4t_max))
        return d


PROFILES: Dict[str, TargetProfile] = {p.name: p for p in (
    TargetProfile("orin-jp5.1", "Jetson AGX Orin / Orin NX / Orin Nano", "5.1", (35, 2, 1), (35, 7), "aarch64",
                  "11.4", "8.5.2", "sm_87", 17, 2, "3.8", ("nvcr.io/nvidia/l4t-jetpack:r35.4.1", "nvcr.io/nvidia/l4t-tensorrt:r8.5.2-runtime"),
                  "https://pypi.jetson-ai-lab.io/jp5/cu114"),
    TargetProfile("xavier-jp5.1", "Jetson AGX Xavier / Xavier NX", "5.1", (35, 2, 1), (35, 7), "aarch64",
                  "11.4", "8.5.2", "sm_72", 17, 2, "3.8", ("nvcr.io/nvidia/l4t-jetpack:r35.4.1", "nvcr.io/nvidia/l4t-tensorrt:r8.5.2-runtime"),
                  "https://pypi.jetson-ai-lab.io/jp5/cu114"),
    TargetProfile("orin-jp6.0", "Jetson Orin", "6.0", (36, 3), (36, 4), "aarch64",
                  "12.2", "8.6.2", "sm_87", 17, 2, "3.10", ("nvcr.io/nvidia/l4t-jetpack:r36.3.0", "nvcr.io/nvidia/l4t-tensorrt:r8.6.2-runtime"),
                  "https://pypi.jetson-ai-lab.io/jp6/cu122"),
    TargetProfile("orin-jp6.1", "Jetson Orin", "6.1", (36, 4, 0), (36, 4, 3), "aarch64",
                  "12.6", "10.3", "sm_87", 20, 2, "3.10", ("nvcr.io/nvidia/l4t-jetpack:r36.4.0", "nvcr.io/nvidia/l4t-tensorrt:r10.3.0-devel"),
                  "https://pypi.jetson-ai-lab.io/jp6/cu126"),
    TargetProfile("orin-jp6.2", "Jetson Orin (+ Super modes)", "6.2", (36, 4, 3), (36, 5), "aarch64",
                  "12.6", "10.3", "sm_87", 20, 2, "3.10", ("nvcr.io/nvidia/l4t-jetpack:r36.4.0", "nvcr.io/nvidia/l4t-tensorrt:r10.3.0-devel"),
                  "https://pypi.jetson-ai-lab.io/jp6/cu126"),
    TargetProfile("thor-jp7.0", "Jetson AGX Thor", "7.0", (38, 2), (39,), "aarch64",
                  "13.0", "10.13", "sm_110", 20, 0, "3.12",
                  # unverified: JETSON.md lists no r38 image tag; JetPack 7 follows the SBSA CUDA images
                  ("nvcr.io/nvidia/cuda:13.0.0-runtime-ubuntu24.04",)),
)}


def load_target(name: str) -> TargetProfile:
    """The profile called ``name``; the error lists the valid names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown target {name!r}; valid targets: {', '.join(sorted(PROFILES))}") from None


@dataclass(frozen=True)
class DeviceInfo:
    """What the agent knows about the machine it runs on."""

    l4t: Optional[Tuple[int, ...]]
    arch: str
    python: str
    source: str

    def describe(self) -> str:
        l4t = ".".join(map(str, self.l4t)) if self.l4t else "none (not a Jetson)"
        return f"L4T {l4t}, {self.arch}, Python {self.python} (from {self.source})"


def parse_l4t(text: str) -> Optional[Tuple[int, ...]]:
    """``# R36 (release), REVISION: 4.3, …`` → (36, 4, 3); also plain ``36.4.3``."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    if m:
        return (int(m.group(1)),) + tuple(int(x) for x in m.group(2).split(".") if x)
    m = re.match(r"^\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def detect_device(release_file: Path = Path("/etc/nv_tegra_release")) -> DeviceInfo:
    """L4T from ``L4T_VERSION`` (containers), else /etc/nv_tegra_release, else dpkg's nvidia-l4t-core."""
    arch, py = platform.machine(), "%d.%d" % sys.version_info[:2]
    if os.environ.get("L4T_VERSION"):
        return DeviceInfo(parse_l4t(os.environ["L4T_VERSION"]), arch, py, "L4T_VERSION")
    if release_file.is_file():
        return DeviceInfo(parse_l4t(release_file.read_text().splitlines()[0]), arch, py, str(release_file))
    try:
        out = subprocess.run(["dpkg-query", "--showformat=${Version}", "--show", "nvidia-l4t-core"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return DeviceInfo(parse_l4t(out.stdout.split("-")[0]), arch, py, "dpkg nvidia-l4t-core")
    except (OSError, subprocess.SubprocessError):
        pass
    return DeviceInfo(None, arch, py, "no L4T found")


def check_compatible(target: TargetProfile, device: DeviceInfo) -> None:
    """Refuse a bundle whose target does not match the device, naming the mismatch."""
    if device.l4t is None:
        raise CheckFailed("target", f"bundle is for {target.name} (L4T {target.to_dict()['l4t_min']}+), "
                                    f"device has {device.describe()}; pass --skip-target-check on a development host")
    if not (target.l4t_min <= device.l4t < target.l4t_max):
        raise CheckFailed("target", f"bundle is for {target.name} (L4T {target.to_dict()['l4t_min']} to before "
                                    f"{target.to_dict()['l4t_max']}), device has {device.describe()}")
    if device.arch != target.arch:
        raise CheckFailed("target", f"bundle is for {target.arch}, device is {device.arch}")
