"""The promote step's lock: one compare-and-promote per policy at a time, through a Prefect global
concurrency limit (``promote-<policy>``, one slot) that every run, nightly or from the UI, takes."""

from __future__ import annotations

from contextlib import contextmanager, suppress
from typing import Iterator

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound


@contextmanager
def promote_slot(policy: str) -> Iterator[None]:
    """Hold the policy's promote slot (creating its one-slot limit on first use) while the block runs. The limit is
    looked up before it is created: a create that collides makes the Prefect server log a database traceback."""
    name = f"promote-{policy}"
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):  # another run created it since the lookup
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    with concurrency(name, occupy=1, strict=True):
        yield
