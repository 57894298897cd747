"""Render an episode's joint trajectory to a GIF with MuJoCo's offscreen renderer.

MuJoCo picks its GL backend when it is first imported, so rendering runs in a child process
with ``MUJOCO_GL`` set (``egl`` unless the caller chose, e.g. ``osmesa``).
Usage: ``python -m stages.twin.video TASK TRAJECTORY.json OUT.gif``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MAX_FRAMES = 30
SIZE = (180, 240)  # height, width


def render(task_ref: str, qpos: list[list[float]], out: Path, period_s: float, timeout_s: float = 120,
           mocap: list[list[float]] | None = None) -> str | None:
    """Write ``out`` (a GIF) of the joint positions ``qpos`` (and mocap bodies at ``mocap``, e.g. a goal marker);
    return None, or why no video could be made (no GL, for instance)."""
    spec = out.with_suffix(".json")
    spec.write_text(json.dumps({"qpos": qpos, "mocap": mocap}))
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    try:
        done = subprocess.run([sys.executable, "-m", "stages.twin.video", task_ref, str(spec), str(out), str(period_s)],
                              env=env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        return f"rendering took over {timeout_s:.0f} s"
    finally:
        spec.unlink(missing_ok=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"MuJoCo offscreen rendering is unavailable (MUJOCO_GL={env['MUJOCO_GL']}): {last}"
    return None


def _main(task_ref: str, spec: str, out: str, period_s: str) -> None:
    import mujoco
    import numpy as np
    from PIL import Image

    from stages.sim.registry import load

    model = load(task_ref).model
    data = mujoco.MjData(model)
    frames_in = json.loads(Path(spec).read_text())
    qpos = np.asarray(frames_in["qpos"])
    mocap = np.asarray(frames_in["mocap"]) if frames_in["mocap"] is not None else np.zeros((len(qpos), 0))
    stride = max(1, -(-len(qpos) // MAX_FRAMES))
    camera = mujoco.MjvCamera()
    mujoco.mjv_defaultFreeCamera(model, camera)
    camera.distance *= 0.9
    frames = []
    with mujoco.Renderer(model, *SIZE) as renderer:
        for q, marks in zip(qpos[::stride], mocap[::stride] if len(mocap) else [None] * len(qpos[::stride])):
            data.qpos[:] = q
            if marks is not None:
                data.mocap_pos[:] = marks.reshape(-1, 3)
            mujoco.mj_forward(model, data)
            renderer.update_scene(data, camera)
            frames.append(Image.fromarray(renderer.render()))
    frames[0].save(out, save_all=True, append_images=frames[1:], duration=int(1000 * float(period_s) * stride), loop=0)


if __name__ == "__main__":
    _main(*sys.argv[1:])
