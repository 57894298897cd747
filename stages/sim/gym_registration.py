"""Every registered task as a gymnasium id, ``sim2edge/<Name>-v0``: ``gym.make`` and ``gym.make_vec`` build it.

``gym.make(id)`` gives :class:`~stages.sim.gym_env.TaskEnv` and ``gym.make_vec(id, num_envs=N)`` the
batched :class:`~stages.sim.gym_vector.GymVectorEnv` (``NEXT_STEP`` autoreset; pass
``autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP`` for no idle step per episode). Keyword arguments go
to the env (``params``, ``randomization``; ``render_mode`` of the single env).

Importing this module registers the ids, gymnasium's own idiom since 1.0 dropped the
``gymnasium.envs`` entry-point plugins; either form works::

    gym.make("stages.sim.gym_registration:sim2edge/Reacher-v0")   # gymnasium imports the module first

    import stages.sim.gym_registration
    gym.register_envs(stages.sim.gym_registration)
    env = gym.make("sim2edge/Reacher-v0")

Tasks from the ``sim2edge.tasks`` entry points are included; call :func:`register_all` again after
registering a task at run time.
"""

from __future__ import annotations

import re

import gymnasium as gym

from stages.sim import registry

NAMESPACE = "sim2edge"


def env_id(task: str) -> str:
    """The gymnasium id of a task name: ``arm6`` → ``sim2edge/Arm6-v0``, ``my_task`` → ``sim2edge/MyTask-v0``."""
    name = "".join(p[:1].upper() + p[1:] for p in re.split(r"[_\W]+", task))
    return f"{NAMESPACE}/{name}-v0"


def register_all() -> list[str]:
    """Register every task of the task registry not registered yet (tasks stay unbuilt); return all their ids."""
    ids = []
    for name in registry.names():
        ids.append(env_id(name))
        if ids[-1] not in gym.registry:
            gym.register(ids[-1], entry_point="stages.sim.gym_env:TaskEnv",
                         vector_entry_point="stages.sim.gym_vector:GymVectorEnv", kwargs={"task": name})
    return ids


register_all()
