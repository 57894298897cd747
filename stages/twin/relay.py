"""A user-space UDP relay between the evaluation host and the device that impairs the control traffic.

For kernels without ``tc netem``: each observation (host → device, "up") and action (device → host,
"down") datagram gets, from a seeded generator per direction, a fate — dropped, or delayed by
``delay_s`` ± ``jitter_s`` (uniform), possibly held back ``reorder_s`` more (so later ones overtake
it), possibly sent twice. The n-th datagram of a direction always gets the same fate for a seed.
Other datagrams (the device's ``S2S1`` statistics) pass at once, uncounted. With netem the same
link is ``tc qdisc add dev IF root netem delay 10ms 3ms loss 5% duplicate 1% reorder 1%``.
"""

from __future__ import annotations

import heapq
import itertools
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edge.control import ACT_MAGIC, OBS_MAGIC
from stages.twin.hil_link import parse_address


class Impairment(BaseModel):
    """What one direction of the link does to each datagram."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    delay_s: float = Field(0.0, ge=0, description="Mean one-way delay added.")
    jitter_s: float = Field(0.0, ge=0, description="Delay spread: uniform in ±jitter_s around delay_s (clipped at 0).")
    loss: float = Field(0.0, ge=0, le=1, description="Probability a datagram is dropped.")
    duplicate: float = Field(0.0, ge=0, le=1, description="Probability a datagram is sent twice.")
    reorder: float = Field(0.0, ge=0, le=1, description="Probability a datagram is held back reorder_s more.")
    reorder_s: float = Field(0.01, ge=0, description="How long a reordered datagram is held back.")


@dataclass(frozen=True)
class Fate:
    drop: bool
    delay_s: float
    copies: int
    held_back: bool


def fates(imp: Impairment, rng: np.random.Generator):
    """The fate of each successive datagram: four uniform draws each, whatever the outcome."""
    while True:
        u = rng.random(4)
        held = bool(u[3] < imp.reorder)
        delay = max(0.0, imp.delay_s + imp.jitter_s * float(2 * u[1] - 1)) + (imp.reorder_s if held else 0.0)
        yield Fate(drop=bool(u[0] < imp.loss), delay_s=delay, copies=2 if u[2] < imp.duplicate else 1, held_back=held)


@dataclass
class Counters:
    """Per direction: datagrams forwarded (once or more), dropped, sent twice, held back, delayed (> 0)."""

    forwarded: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    delayed: int = 0

    def count(self, fate: Fate) -> None:
        if fate.drop:
            self.dropped += 1
            return
        self.forwarded += 1
        self.duplicated += fate.copies - 1
        self.reordered += int(fate.held_back)
        self.delayed += int(fate.delay_s > 0)


@dataclass(order=True)
class _Due:
    at: float
    order: int
    sock: socket.socket = field(compare=False)
    data: bytes = field(compare=False)
    to: object = field(compare=False)


class Relay:
    """Listens on ``listen`` for the host, forwards to ``device`` (both UDP), impairing ``up`` and ``down``.

    Use as a context manager; ``address`` is what the host sends to; ``counters`` {"up", "down"}."""

    def __init__(self, device: str, up: Impairment = Impairment(), down: Impairment | None = None, seed: int = 0,
                 listen: str = "udp://127.0.0.1:0") -> None:
        self.device = parse_address(device)[1]
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(parse_address(listen)[1])
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.bind(("0.0.0.0", 0))
        self.address = "udp://%s:%d" % self.front.getsockname()
        self.counters = {"up": Counters(), "down": Counters()}
        self._fates = {"up": fates(up, np.random.default_rng([seed, 0])),
                       "down": fates(down if down is not None else up, np.random.default_rng([seed, 1]))}
        self._host = None
        self._queue: list[_Due] = []
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s2e-relay", daemon=True)

    def __enter__(self) -> "Relay":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.front.close()
        self.back.close()

    def _schedule(self, direction: str, magic: bytes, data: bytes, sock: socket.socket, to: object) -> None:
        now = time.monotonic()
        if data[:4] != magic:
            heapq.heappush(self._queue, _Due(now, next(self._order), sock, data, to))
            return
        fate = next(self._fates[direction])
        self.counters[direction].count(fate)
        if not fate.drop:
            for _ in range(fate.copies):
                heapq.heappush(self._queue, _Due(now + fate.delay_s, next(self._order), sock, data, to))

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = min(0.05, max(0.0, self._queue[0].at - time.monotonic())) if self._queue else 0.05
            ready, _, _ = select.select([self.front, self.back], [], [], wait)
            for sock in ready:
                data, sender = sock.recvfrom(65536)
                if sock is self.front:
                    self._host = sender
                    self._schedule("up", OBS_MAGIC, data, self.back, self.device)
                elif self._host is not None:
                    self._schedule("down", ACT_MAGIC, data, self.front, self._host)
            while self._queue and self._queue[0].at <= time.monotonic():
                due = heapq.heappop(self._queue)
                try:
                    due.sock.sendto(due.data, due.to)
                except OSError:
                    pass  # the far end is gone; a real link drops it too
