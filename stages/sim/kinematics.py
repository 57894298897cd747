"""Vectorized forward kinematics and base-frame helpers in numpy, so task terms stay functions of (qpos, qvel).

MuJoCo computes positions in ``mj_kinematics`` one configuration at a time; a task's observation
needs them for all N environments per control step, from the *final* joint angles (a sensor
read by ``rollout`` lags one substep, see ``reacher.py``).
"""

from __future__ import annotations

import mujoco
import numpy as np


def quat_to_mat(quat: np.ndarray) -> np.ndarray:
    """(..., 4) unit quaternions (w, x, y, z) → (..., 3, 3) rotation matrices."""
    w, x, y, z = np.moveaxis(quat, -1, 0)
    return np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], -1),
        np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], -1),
        np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1),
    ], -2)


def axis_rotation(axis: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """(N, 3, 3) rotations by ``angle`` (N,) about the unit ``axis`` (3,) (Rodrigues)."""
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    s, c = np.sin(angle)[:, None, None], np.cos(angle)[:, None, None]
    return np.eye(3) + s * k + (1 - c) * (k @ k)


class SitePosition:
    """World position of one site on a serial chain of hinge joints, for N configurations at once."""

    def __init__(self, model: mujoco.MjModel, site: str) -> None:
        sid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, site)
        if sid < 0:
            raise ValueError(f"site {site!r} is not in the model")
        self.site_pos = model.site_pos[sid].copy()
        chain, body = [], int(model.site_bodyid[sid])
        while body > 0:
            joints = []
            for j in range(model.body_jntadr[body], model.body_jntadr[body] + model.body_jntnum[body]):
                if model.jnt_type[j] != mujoco.mjtJoint.mjJNT_HINGE:
                    raise ValueError(f"site {site!r}: joint {model.joint(j).name!r} is not a hinge")
                joints.append((int(model.jnt_qposadr[j]), model.jnt_axis[j].copy(), model.jnt_pos[j].copy()))
            chain.append((model.body_pos[body].copy(), quat_to_mat(model.body_quat[body]), joints))
            body = int(model.body_parentid[body])
        self.chain = chain[::-1]  # root first

    def __call__(self, qpos: np.ndarray) -> np.ndarray:
        """(N, nq) → (N, 3) site position in the world frame."""
        n = len(qpos)
        rot, pos = np.broadcast_to(np.eye(3), (n, 3, 3)), np.zeros((n, 3))
        for body_pos, body_rot, joints in self.chain:
            pos = pos + rot @ body_pos
            rot = rot @ body_rot
            for adr, axis, anchor in joints:
                # rotate about the joint's anchor: the body origin moves unless the anchor is at it
                turn = axis_rotation(axis, qpos[:, adr])
                pos = pos + rot @ anchor - (rot @ turn) @ anchor
                rot = rot @ turn
        return pos + rot @ self.site_pos
