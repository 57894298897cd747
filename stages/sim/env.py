"""N MuJoCo instances stepped per call, the physics of all N in C for the whole control period.

Python runs once per policy step for all N environments: ``mujoco.rollout`` integrates
``decimation`` physics steps with the action held, across a thread pool, releasing the GIL.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import mujoco
import numpy as np
from mujoco import rollout

from stages.sim.disturbance import Disturbance, push_basis, push_coefficients, spread
from stages.sim.params import PhysicalParams, Randomization, actuated_dofs, apply_params, sample_params_batch
from stages.sim.task import Task

STATE_SPEC = mujoco.mjtState.mjSTATE_FULLPHYSICS


def _rows(inputs: dict, rows: np.ndarray) -> dict:
    """The term inputs (commands, {sensor: reading}) of the environments in ``rows``."""
    return {k: v[rows] if isinstance(v, np.ndarray) else {n: r[rows] for n, r in v.items()} for k, v in inputs.items()}


class NonFiniteTerm(ValueError):
    """A task's observation or reward turned NaN/Inf on a finite physics state: a bug in the task's terms."""


@dataclass
class StepResult:
    """One batched step. Shapes: obs (N, obs_dim); reward, terminated, truncated (N,)."""

    obs: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    done: np.ndarray
    """Episodes that ended in this step; the ``finished_*`` arrays follow ``np.flatnonzero(done)``."""
    finished_returns: np.ndarray
    finished_success: np.ndarray
    finished_lengths: np.ndarray
    """Control steps of each finished episode."""
    final_obs: np.ndarray
    """Observations of the finished episodes' last states, before the auto-reset."""
    qpos: np.ndarray
    """(N, nq) positions at the end of this step, before the auto-reset."""
    metrics: dict[str, np.ndarray] = field(default_factory=dict)
    """{name: (N,)} the task's metrics (``Task.step_metrics``) at the end of this step, before the auto-reset."""


class BatchedEnv:
    """Vectorized task environment with per-environment physical parameters and auto-reset."""

    def __init__(
        self,
        task: Task,
        num_envs: int,
        params: PhysicalParams | None = None,
        randomization: Randomization | None = None,
        seed: int = 0,
        nthread: int = 2,
        terminate: bool = True,
        disturbance: Disturbance | None = None,
        backend: str = "mujoco",
    ) -> None:
        """``backend``: "mujoco" (``mujoco.rollout``, C MuJoCo) or "warp" (MuJoCo Warp on its CPU device, float32:
        :mod:`stages.sim.warp_physics`, needs the ``warp`` extra)."""
        if backend not in ("mujoco", "warp"):
            raise ValueError(f"backend must be 'mujoco' or 'warp', not {backend!r}")
        self.task, self.num_envs = task, num_envs
        self._all = np.arange(num_envs)
        self.disturbance = disturbance or Disturbance()
        self.centre = params or task.nominal_params()
        self.randomization = randomization
        self.terminate = terminate
        self.rng = np.random.default_rng(seed)
        nominal = task.model
        self.models = [copy.deepcopy(nominal) for _ in range(num_envs)]
        self.params: list[PhysicalParams] = [self.centre] * num_envs
        self._actuated = actuated_dofs(nominal)
        self._datas = [mujoco.MjData(nominal) for _ in range(nthread)]
        self._pool = rollout.Rollout(nthread=nthread)
        self._warp = None
        if backend == "warp":
            from stages.sim.warp_physics import WarpRollout

            self._warp = WarpRollout(nominal, num_envs)
        self.chunk_size = -(-num_envs // nthread)
        """Envs per rollout task: one chunk per thread (≈10% faster than mujoco's default of smaller chunks here)."""
        self.nq, self.nv, self.nu = nominal.nq, nominal.nv, nominal.nu
        nstate = mujoco.mj_stateSize(nominal, STATE_SPEC)
        self.state = np.zeros((num_envs, nstate))
        self._state_out = np.zeros((num_envs, task.decimation, nstate))
        self._sens_out = np.zeros((num_envs, task.decimation, nominal.nsensordata))
        pushes = self.disturbance.push > 0
        # user inputs held over the control period, in mjtState order: ctrl, [qfrc_applied], [mocap_pos]
        self._control_spec = (mujoco.mjtState.mjSTATE_CTRL | (mujoco.mjtState.mjSTATE_QFRC_APPLIED if pushes else 0)
                              | (mujoco.mjtState.mjSTATE_MOCAP_POS if task.mocap else 0))
        self._mocap_cols = slice(nominal.nu + (nominal.nv if pushes else 0),
                                 nominal.nu + (nominal.nv if pushes else 0) + 3 * nominal.nmocap)
        self._control = np.zeros((num_envs, task.decimation, self._mocap_cols.stop if task.mocap else self._mocap_cols.start))
        self._mocap_pos = np.tile(nominal.body_pos[nominal.body_mocapid >= 0][np.argsort(
            nominal.body_mocapid[nominal.body_mocapid >= 0])].ravel(), (num_envs, 1))
        """(N, 3·nmocap) every mocap body's position; the task's ``mocap_body`` follows its commands."""
        self._push_force = push_basis(nominal, self.disturbance, task.name)
        self._push_phase = np.zeros(num_envs, dtype=np.int64)
        self._push_sign = np.ones((num_envs, len(self._push_force)))
        """(N, k) each environment's current push: its coefficients on the k rows of ``_push_force``."""
        self.obs_bias = np.zeros((num_envs, task.obs_dim), dtype=np.float32)
        max_latency = self.centre.latency_steps + (randomization.latency_steps if randomization else 0) + 1
        self.latency = np.full(num_envs, self.centre.latency_steps)
        """(N,) each environment's action delay in control steps (randomized per episode with a latency range)."""
        self._action_queue = np.zeros((max_latency, num_envs, self.nu), dtype=np.float32)
        self.last_action = np.zeros((num_envs, self.nu), dtype=np.float32)
        """The policy's latest (clipped) action; what ``observe`` of an ``action_history`` task sees."""
        self.sensordata = np.zeros((num_envs, nominal.nsensordata))
        """(N, nsensordata) the last physics step's sensor readings (after a reset: at the initial state)."""
        self._noise = np.array([t.noise for t in task.observations], dtype=np.float32)
        self._delay = np.array([t.delay_steps for t in task.observations], dtype=np.int64)
        self._obs_history = np.zeros((int(self._delay.max(initial=0)) + 1, num_envs, task.obs_dim), dtype=np.float32)
        """Noise-free observations of the last steps (newest first), for terms with ``delay_steps``."""
        self.command = np.zeros((num_envs, len(task.commands)), dtype=np.float32)
        """(N, len(task.commands)) each environment's current commands/goals (episode state beside the physics)."""
        self._resample = np.array([c.resample_steps for c in task.commands], dtype=np.int64)
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.episode_return = np.zeros(num_envs)
        self.obs_noise = np.zeros(num_envs)
        self.reset()

    @property
    def qpos(self) -> np.ndarray:
        return self.state[:, 1 : 1 + self.nq]

    @property
    def qvel(self) -> np.ndarray:
        return self.state[:, 1 + self.nq : 1 + self.nq + self.nv]

    _SNAPSHOT = ("state", "obs_bias", "_push_phase", "_push_sign", "_action_queue", "last_action", "episode_step",
                 "episode_return", "obs_noise", "latency", "command", "sensordata", "_obs_history")

    def snapshot(self) -> dict:
        """Everything the next steps depend on (states, per-env physics, RNG), for an exact resume."""
        return {"arrays": {k: getattr(self, k).copy() for k in self._SNAPSHOT},
                "params": [p.model_dump() for p in self.params], "rng": self.rng.bit_generator.state}

    def restore(self, snap: dict) -> None:
        """Continue exactly where :meth:`snapshot` was taken (same task and env count)."""
        if len(snap["params"]) != self.num_envs:
            raise ValueError(f"snapshot holds {len(snap['params'])} environments, this env has {self.num_envs}")
        for k in self._SNAPSHOT:
            getattr(self, k)[...] = snap["arrays"][k]
        self.params = [PhysicalParams(**p) for p in snap["params"]]
        for model, p in zip(self.models, self.params):
            apply_params(model, self.task.model, p, self.task.mass_mask, self._actuated, self._datas[0])
        if self._warp:
            self._warp.set_models(self.models, self._all)
        self.rng.bit_generator.state = snap["rng"]

    def reset(self, mask: np.ndarray | None = None) -> np.ndarray:
        """Reset the environments in ``mask`` (all by default), re-randomizing their physics."""
        idx = np.arange(self.num_envs) if mask is None else np.flatnonzero(mask)
        d = self.disturbance
        qpos, qvel = spread(*self.task.initial_state(self.rng, len(idx)), self.task.reference_qpos,
                            self.task.replayed_qpos, d.init_spread)
        if d.obs_bias:
            self.obs_bias[idx] = self.rng.uniform(-d.obs_bias, d.obs_bias, (len(idx), self.task.obs_dim))
        if d.push:
            self._push_phase[idx] = self.rng.integers(0, d.push_every, len(idx))
        drawn = (sample_params_batch(self.centre, self.randomization, self.rng, len(idx)) if self.randomization
                 else [self.centre] * len(idx))
        for i, p in zip(idx, drawn):
            if self.randomization or mask is None:
                apply_params(self.models[i], self.task.model, p, self.task.mass_mask, self._actuated, self._datas[0])
            self.params[i] = p
            self.obs_noise[i] = p.obs_noise
            self.latency[i] = p.latency_steps
        if self._warp and (self.randomization or mask is None):
            self._warp.set_models(self.models, idx)
        if self.task.commands:
            self.command[idx] = self.task.sample_commands(self.rng, len(idx))
        self.state[idx] = 0.0
        self.state[idx, 1 : 1 + self.nq] = qpos
        self.state[idx, 1 + self.nq : 1 + self.nq + self.nv] = qvel
        if self.task.sensors:
            self.sensordata[idx] = self.task.sensordata_at(qpos, qvel)
        self._action_queue[:, idx] = 0.0
        self.last_action[idx] = 0.0
        self.episode_step[idx] = 0
        self.episode_return[idx] = 0.0
        if len(self._obs_history) > 1:
            self._obs_history[:, idx] = self._measured()[idx]
        return self.observe()

    def inputs(self) -> dict:
        """The keyword inputs of the task's terms besides the state: commands and sensor readings."""
        return {**self.task.command_args(self.command), **self.task.sensor_args(self.sensordata)}

    def _measured(self) -> np.ndarray:
        """(N, obs_dim) the task's observation of the current state, before bias, noise and sensor delays."""
        history = {"last_action": self.last_action} if self.task.action_history else {}
        return self.task.observe(self.qpos, self.qvel, **history, **self.inputs())

    def observe(self) -> np.ndarray:
        """(N, obs_dim) what the policy sees: each term as its sensor delivers it (delayed, biased, noisy)."""
        if len(self._obs_history) > 1:
            obs = self._obs_history[self._delay, :, np.arange(self.task.obs_dim)].T
        else:
            obs = self._measured()
        obs = obs + self.obs_bias
        if self.obs_noise.any():
            obs = obs + (self.rng.standard_normal(obs.shape) * self.obs_noise[:, None]).astype(np.float32)
        if self._noise.any():
            obs = obs + (self.rng.standard_normal(obs.shape) * self._noise).astype(np.float32)
        return obs

    def privileged(self) -> np.ndarray:
        """(N, len(task.privileged)) the simulator-only terms the critic sees (noise-free)."""
        history = {"last_action": self.last_action} if self.task.action_history else {}
        return self.task.observe_privileged(self.qpos, self.qvel, **history, **self.inputs()).astype(np.float32)

    def _push(self, action: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The action queue as it is after this step (newest first), in ``out`` (``step`` passes the queue itself)."""
        queue = np.empty_like(self._action_queue) if out is None else out
        queue[1:] = self._action_queue[:-1]  # numpy buffers overlapping slices, so in place is safe
        np.clip(action, -1.0, 1.0, out=queue[0])
        return queue

    def _controls(self, queue: np.ndarray) -> np.ndarray:
        """Actuator controls from an action queue (newest first), after the action latency."""
        return self.task.action_default + self.task.action_scale * queue[self.latency, np.arange(self.num_envs)]

    def controls_preview(self, action: np.ndarray) -> np.ndarray:
        """Actuator controls that ``step(action)`` will apply."""
        return self._controls(self._push(action))

    def step(self, action: np.ndarray, substeps: np.ndarray | None = None) -> StepResult:
        """Hold ``action`` (N, nu) for one control period, then compute terms and auto-reset.

        ``substeps`` (N, decimation, nu): normalized actions applied physics substep by substep instead
        of holding ``action`` (an actuator that takes a command mid-period, as in hardware-in-the-loop);
        ``action`` is still the period's action (action queue, reward, ``last_action``). Only without
        action latency: the substep profile is the action in effect, not one to delay."""
        if substeps is not None and self.latency.any():
            raise ValueError(f"per-substep actions need latency_steps 0, this env has {int(self.latency.max())}")
        self._push(action, out=self._action_queue)
        history = {"last_action": self.last_action.copy()} if self.task.action_history else {}
        self.last_action[:] = self._action_queue[0]
        self._control[:, :, : self.nu] = (self._controls(self._action_queue)[:, None, :] if substeps is None else
                                          self.task.action_default + self.task.action_scale * np.clip(substeps, -1, 1))
        if self.disturbance.push:
            self._control[:, :, self.nu : self._mocap_cols.start] = self._push_forces()[:, None, :]
        if self.task.mocap:
            self._control[:, :, self._mocap_cols] = self.mocap_positions()[:, None, :]
        if self._warp:
            self._warp.rollout(self.state, self._control, self._control_spec, self.task.decimation,
                               self._state_out, self._sens_out)
        else:
            self._pool.rollout(
                self.models, self._datas, self.state, self._control, control_spec=self._control_spec,
                nstep=self.task.decimation, skip_checks=True, state=self._state_out, sensordata=self._sens_out,
                chunk_size=self.chunk_size,
            )
        self.state[:] = self._state_out[:, -1]
        self.sensordata[:] = self._sens_out[:, -1]
        if len(self._obs_history) > 1:
            self._obs_history[1:] = self._obs_history[:-1]
            self._obs_history[0] = self._measured()
        qpos, qvel = self.qpos.copy(), self.qvel
        inputs = {k: (v.copy() if k == "command" else {n: r.copy() for n, r in v.items()})
                  for k, v in self.inputs().items()}
        reward = self.task.reward(qpos, qvel, self._action_queue[0], **history, **inputs)
        metrics = self.task.step_metrics(qpos, qvel, **inputs)
        # a NaN state terminates the episode (and would be reported by the caller)
        terminated = ~np.all(np.isfinite(self.state), axis=1)
        if self.terminate:
            terminated |= self.task.terminated(qpos, qvel, **inputs)
        self.episode_step += 1
        self._check_finite("reward()", reward, self._all)
        self.episode_return += reward
        truncated = (self.episode_step >= self.task.episode_steps) & ~terminated
        done = terminated | truncated
        returns = self.episode_return[done].copy()
        lengths = self.episode_step[done].copy()
        success = truncated[done] & (returns >= self.task.success_threshold)
        if done.any():
            success &= self.task.succeeded(qpos[done], qvel[done], **_rows(inputs, done))
        self._resample_commands(done)
        if done.any():
            final_obs = self.observe()[done]
            self._check_finite("", final_obs, np.flatnonzero(done))
            obs = self.reset(done)
        else:
            final_obs, obs = np.zeros((0, self.task.obs_dim), dtype=np.float32), self.observe()
        self._check_finite("", obs, self._all)
        return StepResult(obs, reward, terminated, truncated, done, returns, success, lengths, final_obs, qpos, metrics)

    def _check_finite(self, name: str, values: np.ndarray, envs: np.ndarray) -> None:
        """Stop at the first NaN/Inf in ``values`` (a reward (N,) or observations (rows, obs_dim) of ``envs``)
        computed from a finite physics state and finite actions, naming the term, the env and its episode
        step. An unstable simulation (a non-finite state) is not the task's fault: it terminates its episode
        instead; nor is a non-finite action (a diverged policy: training reports that itself)."""
        if np.isfinite(values).all():  # the common case, without the per-env state and action checks
            return
        finite = np.all(np.isfinite(self.state[envs]), axis=1) & np.all(np.isfinite(self._action_queue[:, envs]),
                                                                         axis=(0, 2))
        bad = ~np.isfinite(values) & (finite[:, None] if values.ndim == 2 else finite)
        if bad.any():
            row, *col = (int(v) for v in np.argwhere(bad)[0])
            term = f"observation term {self.task.observations[col[0]].name!r}" if col else name
            i = int(envs[row])
            value = values[row, col[0]] if col else values[row]
            raise NonFiniteTerm(f"task {self.task.name!r}: {term} is {value} in env {i} at episode step "
                                f"{self.episode_step[i]}, on a finite physics state and actions")

    def _resample_commands(self, done: np.ndarray) -> None:
        """Commands with ``resample_steps`` are drawn again every that many steps of a running episode."""
        if not self._resample.any():
            return
        due = ((self.episode_step[:, None] % np.maximum(self._resample, 1)) == 0) & (self._resample > 0) & ~done[:, None]
        envs = np.flatnonzero(due.any(axis=1))
        if len(envs):
            fresh = self.task.sample_commands(self.rng, len(envs))
            self.command[envs] = np.where(due[envs], fresh, self.command[envs])

    def mocap_positions(self) -> np.ndarray:
        """(N, 3·nmocap) mocap body positions: the task's ``mocap_body`` at its commands, the others where the MJCF
        puts them."""
        index, cols = self.task.mocap
        self._mocap_pos[:, 3 * index : 3 * index + 3] = self.command[:, cols]
        return self._mocap_pos

    @property
    def push_direction(self) -> np.ndarray:
        """(N, k) each environment's current push: a unit direction in the x–y plane (base pushes) or a sign per
        pushed term; multiplied by the push force while a push is on."""
        return self._push_sign.copy()

    @property
    def push_phase(self) -> np.ndarray:
        """(N,) each environment's offset into the ``push_every`` cycle, drawn at its reset."""
        return self._push_phase.copy()

    def _push_forces(self) -> np.ndarray:
        """(N, nv) this step's push: on for ``push_steps`` of every ``push_every`` steps, a random sign or direction
        per push."""
        d = self.disturbance
        phase = (self.episode_step + self._push_phase) % d.push_every
        starting = phase == 0
        self._push_sign[starting] = push_coefficients(d, self.rng, int(starting.sum()))
        on = (phase < d.push_steps) & (self.episode_step > 0)
        return np.where(on[:, None], self._push_sign @ self._push_force, 0.0)
