"""Rollout collection in a child process (``TrainConfig.collector="process"``), so physics and acting run beside
the learner's update without sharing its GIL.

The child owns its own :class:`BatchedEnv` (the same seeded environments the learner would have stepped) and an
acting PPO copy on the CPU. Each rollout, with its returns and advantages, lands in shared-memory tensors the
learner copies into ``alg.storage``; the weights travel the other way through shared tensors. The pipe carries
only the handshake and the finished episodes' statistics. Policy lag is one update, as with the thread
(:class:`stages.train.OverlappedSampler`): while the learner updates on rollout k, the child collects k+1 with
the weights from before that update. Neither the child's environment nor its pending rollout is checkpointed,
so :func:`stages.train.train` refuses ``resume`` and ``checkpoint_every`` with this collector. Spawning re-imports
the main module: a script that trains with it needs the ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Iterator

import torch
import torch.multiprocessing as mp
from rsl_rl.algorithms import PPO
from rsl_rl.storage import RolloutStorage

from stages.sim.env import NonFiniteTerm
from stages.sim.params import PhysicalParams
from stages.sim.task import Task
from stages.train import Collected, RslRlEnv, Sampler, TrainConfig, build_algorithm, make_env

Weights = dict[str, dict[str, torch.Tensor]]
"""``{"actor": state_dict, "critic": state_dict}`` in shared memory."""

_FIELDS = ("actions", "rewards", "dones", "values", "actions_log_prob", "returns", "advantages")


class CollectorError(RuntimeError):
    """The rollout process failed or died; the message names how."""


def _tensors(storage: RolloutStorage) -> dict[str, torch.Tensor]:
    """What a filled rollout holds (``compute_returns`` included), by name; the storage's own tensors."""
    return {**{f"obs/{k}": v for k, v in storage.observations.items()}, **{k: getattr(storage, k) for k in _FIELDS},
            **{f"dist/{i}": p for i, p in enumerate(storage.distribution_params or ())}}


def _child(conn: Connection, cfg: TrainConfig, task: Task, twin: PhysicalParams, weights: Weights) -> None:
    """Collect a rollout with the published weights on each ``"collect"``; stop on anything else or a closed pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the learner, which stops this process
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    try:
        vec_env = RslRlEnv(make_env(cfg, task, twin))
        acting = build_algorithm(cfg, vec_env)
        acting.train_mode()
        sampler, shared = Sampler(acting, vec_env, cfg), None
        while conn.recv() == "collect":
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
            conn.send(("done", seconds, shared if fresh else None, vec_env.finished.take()))
    except EOFError:  # the learner is gone
        pass
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the learner, by name
        with contextlib.suppress(OSError):
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))


class ProcessSampler(Sampler):
    """Collects the next rollout in a child process (spawned) while the update runs; see the module docstring."""

    def __init__(self, alg: PPO, vec_env: RslRlEnv, cfg: TrainConfig, task: Task, twin: PhysicalParams) -> None:
        super().__init__(alg, vec_env, cfg)
        ctx = mp.get_context("spawn")  # forking after torch/OpenMP started threads can deadlock the child
        self.weights: Weights = {name: {k: v.detach().to("cpu", copy=True).share_memory_()
                                        for k, v in getattr(alg, name).state_dict().items()}
                                 for name in ("actor", "critic")}
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(theirs, cfg, task, twin, self.weights),
                                   name="sim2edge-rollout", daemon=True)
        self.process.start()
        theirs.close()
        self.shared: dict[str, torch.Tensor] | None = None
        self.pending = False  # a rollout is being collected

    def _request(self) -> None:
        """Publish the learner's current weights and start the next rollout with them."""
        for name, tensors in self.weights.items():
            for k, v in getattr(self.alg, name).state_dict().items():
                tensors[k].copy_(v)
        self.conn.send("collect")
        self.pending = True

    def _receive(self) -> Collected:
        """Wait for the pending rollout; copy it into ``alg.storage`` and its episodes into the env's statistics."""
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                break
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(10)
            code = self.process.exitcode
            raise CollectorError(f"the rollout process exited (code {code}) without a rollout") from None
        finally:
            self.pending = False
        if message[0] == "error":
            _, name, text, trace = message
            if name == NonFiniteTerm.__name__:
                raise NonFiniteTerm(text)
            raise CollectorError(f"the rollout process failed: {name}: {text}\n{trace}")
        _, seconds, shared, finished = message
        self.shared = shared if shared is not None else self.shared
        storage = self.alg.storage
        if storage.distribution_params is None:  # rsl_rl allocates these on the first transition
            storage.distribution_params = tuple(torch.empty_like(v, device=storage.device)
                                                for k, v in self.shared.items() if k.startswith("dist/"))
        for k, v in _tensors(storage).items():
            v.copy_(self.shared[k])
        storage.step = storage.num_transitions_per_env
        self.vec_env.finished.add(finished)
        return Collected(seconds)

    @contextlib.contextmanager
    def rollout(self, more: bool) -> Iterator[Collected]:
        if not self.pending:  # the first rollout
            self._request()
        collected = self._receive()
        if more:
            self._request()  # with the weights from before this update: one policy lag
        yield collected

    def close(self) -> None:
        """Stop the child: at once if it is mid-rollout, else by asking; it is always gone afterwards."""
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
