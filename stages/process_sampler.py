"""Rollout collection in child processes (``TrainConfig.collector="process"``), so physics and acting run beside
the learner's update without sharing its GIL.

Each child owns its own :class:`BatchedEnv` and an acting PPO copy on the CPU. Each rollout, with its returns and
advantages, lands in shared-memory tensors the learner copies into ``alg.storage``; the weights travel the other
way through shared tensors. The pipe carries only the handshake and the finished episodes' statistics. Policy lag
is one update, as with the thread (:class:`stages.samplers.OverlappedSampler`): while the learner updates on rollout
k, the children collect k+1 with the weights from before that update. That lag is part of the run's state: each
child sends, with its rollout, its state after it (environments, torch RNG), which is where its next rollout starts,
and :meth:`ProcessSampler.state` is those snapshots with the weights the next rollout is (or will be) collected with.
A checkpoint carries it, and :meth:`ProcessSampler.restore` puts the children back there, so a resumed run equals
the uninterrupted one bit for bit (``tests/test_process_sampler.py``). Spawning re-imports the main module: a script
that trains with it needs the ``if __name__ == "__main__":`` guard.

``TrainConfig.collector_processes`` = K > 1 splits the ``num_envs`` environments into K contiguous slices of
``num_envs / K``, one child each (each with ``cfg.nthread`` physics threads). Child i writes columns
``[i·n, (i+1)·n)`` of the rollout's environment dimension (rsl_rl's storage is ``[steps, envs, ...]``). Seeds:
child i's environments are ``BatchedEnv(seed=cfg.seed + i)`` and its action noise ``torch.manual_seed(cfg.seed
+ i)``. A BatchedEnv draws all its environments from one generator, so per-environment seeds as the single
environment would draw them cannot be reproduced by a slice: the union is reproducible for a given (seed, K) but
is not the K = 1 run's environments (slice 0 with K = 1 is exactly today's child). Returns and advantages (GAE is
per environment) are computed in each child over its slice; rsl_rl's ``PPO.compute_returns`` then normalizes the
advantages over the slice, so with K > 1 the learner recomputes them as ``returns - values`` normalized over the
whole batch, as one child would have (unless ``normalize_advantage_per_mini_batch``, where the update does it).
The learner waits for all K children each rollout; ``Collected.seconds`` is the slowest child's.
"""

from __future__ import annotations

import contextlib
import signal
import traceback
from multiprocessing.connection import Connection, wait
from typing import Iterator

import torch
import torch.multiprocessing as mp
from rsl_rl.algorithms import PPO
from rsl_rl.storage import RolloutStorage

from stages.rsl_env import FinishedEpisodes, RslRlEnv, build_algorithm, make_env
from stages.samplers import Collected, Sampler, decouple
from stages.sim.env import NonFiniteTerm
from stages.sim.params import PhysicalParams
from stages.sim.task import Task
from stages.train_config import TrainConfig

Weights = dict[str, dict[str, torch.Tensor]]
"""``{"actor": state_dict, "critic": state_dict}`` in shared memory."""

_FIELDS = ("actions", "rewards", "dones", "values", "actions_log_prob", "returns", "advantages")


class CollectorError(RuntimeError):
    """A rollout process failed or died; the message names how."""


def _tensors(storage: RolloutStorage) -> dict[str, torch.Tensor]:
    """What a filled rollout holds (``compute_returns`` included), by name; the storage's own tensors."""
    return {**{f"obs/{k}": v for k, v in storage.observations.items()}, **{k: getattr(storage, k) for k in _FIELDS},
            **{f"dist/{i}": p for i, p in enumerate(storage.distribution_params or ())}}


def slice_config(cfg: TrainConfig, index: int) -> TrainConfig:
    """The config child ``index`` of ``cfg.collector_processes`` builds its environments and acting copy from."""
    k = cfg.collector_processes
    return cfg.model_copy(update={"num_envs": cfg.num_envs // k, "seed": cfg.seed + index, "collector_processes": 1})


def _child(conn: Connection, cfg: TrainConfig, task: Task, twin: PhysicalParams, weights: Weights) -> None:
    """Collect a rollout with the published weights on each ``("collect",)``, restore a snapshot on
    ``("restore", snapshot)``; stop on ``"stop"`` or a closed pipe. ``cfg`` is this child's (:func:`slice_config`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the learner, which stops this process
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    try:
        vec_env = RslRlEnv(make_env(cfg, task, twin))
        acting = build_algorithm(cfg, vec_env)
        acting.train_mode()
        sampler, shared = Sampler(acting, vec_env, cfg), None
        while (command := conn.recv()) != "stop":
            if command[0] == "restore":  # where an earlier run's rollout of this slice would have started
                vec_env.restore(command[1]["env"])
                torch.set_rng_state(command[1]["torch_rng"])
                continue
            acting.actor.load_state_dict(weights["actor"])
            acting.critic.load_state_dict(weights["critic"])
            seconds = sampler._collect(acting)
            rollout = _tensors(acting.storage)
            fresh = shared is None
            if fresh:
                shared = {k: v.clone().share_memory_() for k, v in rollout.items()}
            else:
                for k, v in rollout.items():
                    shared[k].copy_(v)
            acting.storage.clear()
            after = {"env": vec_env.snapshot(), "torch_rng": torch.get_rng_state()}  # where the next rollout starts
            conn.send(("done", seconds, shared if fresh else None, vec_env.finished.take(), after))
    except EOFError:  # the learner is gone
        pass
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the learner, by name
        with contextlib.suppress(OSError):
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))


class _Child:
    """One rollout process, its pipe and the shared tensors of its slice."""

    def __init__(self, ctx, cfg: TrainConfig, task: Task, twin: PhysicalParams, weights: Weights, index: int) -> None:
        k = cfg.collector_processes
        self.label = "the rollout process" if k == 1 else f"rollout process {index + 1} of {k}"
        n = cfg.num_envs // k
        self.columns = slice(index * n, (index + 1) * n)
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(theirs, slice_config(cfg, index), task, twin, weights),
                                   name="sim2edge-rollout", daemon=True)
        self.process.start()
        theirs.close()
        self.shared: dict[str, torch.Tensor] | None = None
        self.pending = False  # a rollout is being collected
        self.snapshot: dict | None = None  # the child's state where its next rollout starts (None: as spawned)

    def message(self) -> tuple:
        """The pending rollout's message (waiting for it); CollectorError if the process died without one."""
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                break
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(10)
            code = self.process.exitcode
            raise CollectorError(f"{self.label} exited (code {code}) without a rollout") from None
        finally:
            self.pending = False

    def close(self) -> None:
        """Stop the process: at once if it is mid-rollout, else by asking; it is always gone afterwards."""
        if self.process.is_alive() and not self.pending:
            with contextlib.suppress(OSError):
                self.conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class ProcessSampler(Sampler):
    """Collects the next rollout in ``cfg.collector_processes`` child processes (spawned) while the update runs;
    see the module docstring."""

    def __init__(self, alg: PPO, vec_env: RslRlEnv, cfg: TrainConfig, task: Task, twin: PhysicalParams) -> None:
        super().__init__(alg, vec_env, cfg)
        ctx = mp.get_context("spawn")  # forking after torch/OpenMP started threads can deadlock the child
        self.weights: Weights = {name: {k: v.detach().to("cpu", copy=True).share_memory_()
                                        for k, v in getattr(alg, name).state_dict().items()}
                                 for name in ("actor", "critic")}
        self.children: list[_Child] = []
        try:
            for i in range(cfg.collector_processes):
                self.children.append(_Child(ctx, cfg, task, twin, self.weights, i))
        except BaseException:
            self.close()
            raise

    @property
    def pending(self) -> bool:
        return any(c.pending for c in self.children)

    def _publish(self) -> None:
        """Make the learner's current weights the ones the next rollout is collected with."""
        for name, tensors in self.weights.items():
            for k, v in getattr(self.alg, name).state_dict().items():
                tensors[k].copy_(v)

    def _request(self) -> None:
        """Start the next rollout with the published weights."""
        for child in self.children:
            child.conn.send(("collect",))
            child.pending = True

    def _receive(self) -> Collected:
        """Wait for every child's slice of the pending rollout; copy them into ``alg.storage`` and their episodes
        into the env's statistics. The first failure is raised (the others are stopped by :meth:`close`)."""
        waiting = {c.conn: c for c in self.children if c.pending}
        seconds, finished = 0.0, FinishedEpisodes()
        while waiting:
            ready = wait(list(waiting), timeout=0.5)
            dead = [conn for conn, c in waiting.items() if conn not in ready and not c.process.is_alive()]
            for conn in [*ready, *dead]:
                child = waiting.pop(conn)
                message = child.message()
                if message[0] == "error":
                    _, name, text, trace = message
                    if name == NonFiniteTerm.__name__:
                        raise NonFiniteTerm(text)
                    raise CollectorError(f"{child.label} failed: {name}: {text}\n{trace}")
                _, child_seconds, shared, child_finished, child.snapshot = message
                child.shared = shared if shared is not None else child.shared
                seconds = max(seconds, child_seconds)
                finished.add(child_finished)
        storage = self.alg.storage
        if storage.distribution_params is None:  # rsl_rl allocates these on the first transition
            storage.distribution_params = tuple(
                torch.empty((v.shape[0], storage.num_envs, *v.shape[2:]), dtype=v.dtype, device=storage.device)
                for k, v in self.children[0].shared.items() if k.startswith("dist/"))
        for child in self.children:
            for k, v in _tensors(storage).items():
                v[:, child.columns].copy_(child.shared[k])
        if len(self.children) > 1:  # each child normalized its own slice's advantages: normalize the whole batch
            advantages = storage.returns - storage.values
            if not self.alg.normalize_advantage_per_mini_batch:
                advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
            storage.advantages.copy_(advantages)
        storage.step = storage.num_transitions_per_env
        self.vec_env.finished.add(finished)
        return Collected(seconds)

    @contextlib.contextmanager
    def rollout(self, more: bool) -> Iterator[Collected]:
        if not self.pending:  # the first rollout
            self._publish()
            self._request()
        collected = self._receive()
        decouple(self.alg)
        self._publish()  # the weights from before this update: one policy lag (and a checkpoint's, after the last)
        if more:
            self._request()
        yield collected

    def state(self) -> dict:
        """Where collection continues: the next rollout's weights and each child's state at its start."""
        return {"weights": {name: {k: v.clone() for k, v in t.items()} for name, t in self.weights.items()},
                "children": [child.snapshot for child in self.children]}

    def restore(self, state: dict) -> None:
        """Continue from :meth:`state` of a run with the same config: its weights published, each child put back
        where its next rollout started, and that rollout requested."""
        for name, tensors in self.weights.items():
            for k, v in state["weights"][name].items():
                tensors[k].copy_(v)
        for child, snapshot in zip(self.children, state["children"], strict=True):
            if snapshot is not None:
                child.conn.send(("restore", snapshot))
            child.snapshot = snapshot
        self._request()

    def close(self) -> None:
        """Stop every child (see :meth:`_Child.close`); all are gone afterwards."""
        for child in self.children:
            child.close()
