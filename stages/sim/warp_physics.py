"""The batched physics step of :class:`~stages.sim.env.BatchedEnv` on MuJoCo Warp: one world per environment.

:meth:`WarpRollout.rollout` does what ``mujoco.rollout`` does for the env (initial states in the
``mjSTATE_FULLPHYSICS`` layout, controls per substep in a ``control_spec`` layout, ``nstep`` steps, every
substep's state and sensor readings out), on warp's CPU device by default. Each environment's physical
parameters are per-world model fields: :meth:`WarpRollout.set_models` copies them from the env's ``MjModel``s.
Needs the ``warp`` extra (``mujoco-warp``, ``warp-lang``).
"""

from __future__ import annotations

import mujoco
import mujoco_warp as mjw
import numpy as np
import warp as wp

PER_WORLD = ("dof_damping", "dof_armature", "dof_frictionloss", "actuator_gainprm", "actuator_biasprm", "body_mass",
             "body_inertia", "body_subtreemass", "body_invweight0", "dof_invweight0", "actuator_acc0")
"""The model fields :func:`stages.sim.params.apply_params` writes, and those its ``mj_setConst`` recomputes."""

S = mujoco.mjtState
_STATE = {S.mjSTATE_TIME: "time", S.mjSTATE_QPOS: "qpos", S.mjSTATE_QVEL: "qvel", S.mjSTATE_ACT: "act"}
_CONTROL = {S.mjSTATE_CTRL: "ctrl", S.mjSTATE_QFRC_APPLIED: "qfrc_applied", S.mjSTATE_MOCAP_POS: "mocap_pos"}
_LOST = mjw.OverflowType.NEFC | mjw.OverflowType.NJMAX_NNZ | mjw.OverflowType.BROADPHASE | mjw.OverflowType.NARROWPHASE
"""Overflows that drop contacts or constraints (the physics would be wrong), as against a solver iteration limit."""


def _layout(model: mujoco.MjModel, spec: int, fields: dict[int, str]) -> list[tuple[str, slice]]:
    """(Data field, columns) of each component of ``spec`` in mjtState order; a non-empty unsupported one is refused."""
    out, start = [], 0
    bits = sorted((b for b in S.__members__.values() if int(b) & (int(b) - 1) == 0 and int(b) & int(spec)), key=int)
    for bit in bits:
        size = mujoco.mj_stateSize(model, bit)
        if size and bit not in fields:
            raise ValueError(f"the warp backend does not support state component {bit.name}")
        if size:
            out.append((fields[bit], slice(start, start + size)))
        start += size
    return out


class WarpRollout:
    """``nworld`` copies of ``model`` in one MuJoCo Warp model and data, with per-world :data:`PER_WORLD` fields."""

    def __init__(self, model: mujoco.MjModel, nworld: int, device: str = "cpu") -> None:
        self.mjmodel, self.nworld, self.device = model, nworld, wp.get_device(device)
        self._state_cols = _layout(model, S.mjSTATE_FULLPHYSICS, _STATE)
        with wp.ScopedDevice(self.device):
            self.model = mjw.put_model(model, batch_sizes=dict.fromkeys(PER_WORLD, nworld))
            self.data = mjw.put_data(model, mujoco.MjData(model), nworld=nworld)

    def set_models(self, models: list[mujoco.MjModel], rows: np.ndarray) -> None:
        """Copy the :data:`PER_WORLD` fields of ``models[i]`` into world ``i`` for each ``i`` in ``rows``."""
        for name in PER_WORLD:
            array = getattr(self.model, name)
            host = array.numpy()  # on the CPU a view of the array
            host[rows] = np.stack([getattr(models[i], name) for i in rows])
            array.assign(host)

    def rollout(self, initial_state: np.ndarray, control: np.ndarray, control_spec: int, nstep: int,
                state: np.ndarray, sensordata: np.ndarray) -> None:
        """Step every world ``nstep`` times from ``initial_state`` (nworld, nstate) under ``control`` (nworld, nstep,
        ncontrol); write each substep's state into ``state`` (nworld, nstep, nstate) and sensor readings into
        ``sensordata`` (nworld, nstep, nsensordata), as ``mujoco.rollout`` does."""
        d, state_cols = self.data, self._state_cols
        control_cols = _layout(self.mjmodel, control_spec, _CONTROL)
        with wp.ScopedDevice(self.device):
            for name, cols in state_cols:
                self._put(name, initial_state[:, cols])
            d.qacc_warmstart.zero_()
            for k in range(nstep):
                for name, cols in control_cols:
                    self._put(name, control[:, k, cols])
                mjw.step(self.model, d)
                for name, cols in state_cols:
                    state[:, k, cols] = getattr(d, name).numpy().reshape(self.nworld, -1)
                sensordata[:, k] = d.sensordata.numpy()
        lost = d.overflow.numpy() & int(_LOST)
        if lost.any():
            raise RuntimeError(f"MuJoCo Warp dropped contacts or constraints ({mjw.OverflowType(int(lost.max()))!r} "
                               f"in worlds {np.flatnonzero(lost)[:8].tolist()}): put_data's default nconmax/njmax are "
                               "too small for this model")

    def _put(self, name: str, values: np.ndarray) -> None:
        """Write (nworld, n) ``values`` into the Data field ``name``."""
        array = getattr(self.data, name)
        array.assign(values.reshape(array.shape + getattr(array.dtype, "_shape_", ())).astype(np.float32))
