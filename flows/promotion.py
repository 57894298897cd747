"""The promote step's lock: one compare-and-promote per policy at a time, through a Prefect global
concurrency limit (``promote-<policy>``, one slot) that every run, nightly or from the UI, takes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists


@contextmanager
def promote_slot(policy: str) -> Iterator[None]:
    """Hold the policy's promote slot (creating its one-slot limit on first use) while the block runs."""
    name = f"promote-{policy}"
    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
    with concurrency(name, occupy=1, strict=True):
        yield
