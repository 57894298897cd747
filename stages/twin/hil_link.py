"""The evaluation host's end of the device link: one datagram socket to ``sim2edge-agent run``.

The wire format is ``edge.control``'s (imported, never restated here). ``align`` measures the device
loop's tick phase, so the host can send each observation just before the device's tick.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from edge.control import FRESH, STATS_MAGIC, WATCHDOG, decode_action, encode_observation


def parse_address(address: str) -> tuple[int, object]:
    """``udp://HOST:PORT`` or ``unix:///PATH`` → (socket family, peer address)."""
    if address.startswith("udp://"):
        host, _, port = address[6:].rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"device address {address!r} must be udp://HOST:PORT with a port in 0..65535")
        return socket.AF_INET, (host, int(port))
    if address.startswith("unix://") and len(address) > 7:
        return socket.AF_UNIX, address[7:]
    raise ValueError(f"device address {address!r} must be udp://HOST:PORT or unix:///PATH")


class DeviceFailed(OSError):
    """A device that did not answer, fell silent or restarted, or whose link failed; the message starts with its
    address."""


@dataclass(frozen=True)
class Arrival:
    """One action datagram as the host received it (``at``: host monotonic clock)."""

    seq: int
    stamp: float
    flags: int
    values: np.ndarray
    at: float


class DeviceLink:
    """A datagram socket to the device; a Unix client binds its own path, where the device sends replies.

    ``restart``: the first action that told a restart of the device (a FRESH action answering a newer observation
    than the newest settled one: a copy or a reordered datagram of the device's first actions answers an older one)."""

    def __init__(self, address: str) -> None:
        family, self.peer = parse_address(address)
        self.settled_seq: Optional[int] = None
        self.restart: Optional[Arrival] = None
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self._dir = None
        if family == socket.AF_UNIX:
            self._dir = tempfile.mkdtemp(prefix="s2e-hil-")
            self.sock.bind(os.path.join(self._dir, "host.sock"))
        self.sock.setblocking(False)

    def send_observation(self, seq: int, values: np.ndarray, state: Optional[np.ndarray] = None) -> float:
        """Send one observation stamped with the host clock; returns the stamp."""
        stamp = time.monotonic()
        self.sock.sendto(encode_observation(seq, stamp, values, state), self.peer)
        return stamp

    def receive(self, until: float, awaited: Optional[int] = None) -> list[Arrival]:
        """Every action datagram arriving before the host clock reaches ``until`` (at least one poll), or up to
        the action answering seq ``awaited``."""
        got: list[Arrival] = []
        while not (got and got[-1].seq == awaited and not got[-1].flags & WATCHDOG):
            ready, _, _ = select.select([self.sock], [], [], max(0.0, until - time.monotonic()))
            if not ready:
                return got
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                continue
            at = time.monotonic()
            try:
                seq, stamp, flags, values = decode_action(data)
            except (ValueError, struct.error):
                continue  # not an action (a stats reply, a stray datagram)
            got.append(self._note(Arrival(seq, stamp, flags, values.copy(), at)))
        return got

    def _note(self, arrival: Arrival) -> Arrival:
        """Follow the device's FRESH flags: a settled device's fresh action is a restart."""
        if not arrival.flags & FRESH:
            self.settled_seq = max(arrival.seq, self.settled_seq or 0)
        elif self.restart is None and self.settled_seq is not None and arrival.seq > self.settled_seq:
            self.restart = arrival
        return arrival

    def stats(self, timeout_s: float = 1.0, tries: int = 3) -> Optional[dict]:
        """The device's own statistics (``S2S1``), or None if no reply came."""
        for _ in range(tries):
            self.sock.sendto(STATS_MAGIC, self.peer)
            end = time.monotonic() + timeout_s
            while (left := end - time.monotonic()) > 0:
                ready, _, _ = select.select([self.sock], [], [], left)
                if ready:
                    data = self.sock.recv(65536)
                    if data.startswith(STATS_MAGIC):
                        return json.loads(data[4:])
        return None

    def close(self) -> None:
        self.sock.close()
        if self._dir:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)


@dataclass(frozen=True)
class Phase:
    """The device loop's timing as probes saw it: replies arrive at ``reply_phase_s`` (mod the period)
    after a minimum round trip of ``min_rtt_s``; ``send_phase_s`` is when to send, ``lead_s`` before its tick."""

    reply_phase_s: float
    min_rtt_s: float
    send_phase_s: float
    probes_sent: int
    probes_answered: int


def align(link: DeviceLink, obs: np.ndarray, period: float, first_seq: int, probes: int, lead_s: float) -> Phase:
    """Probe the device with ``probes`` observations spread over the period's phases.

    Replies leave the device at its tick, so their arrival phase is fixed; the smallest round trip is
    the link's and the device's own time. Sending ``min_rtt + lead`` before the reply phase puts the
    observation at the device ``lead_s`` before its tick (on a symmetric link)."""
    sent: dict[int, float] = {}
    replies: list[tuple[float, float]] = []
    for k in range(probes):
        seq = first_seq + k
        sent[seq] = link.send_observation(seq, obs)
        for a in link.receive(time.monotonic() + period * (1 + 1 / probes)):  # step the phase by period/probes
            if a.seq in sent:
                replies.append((a.at, a.at - sent.pop(a.seq)))
    for a in link.receive(time.monotonic() + 2 * period):
        if a.seq in sent:
            replies.append((a.at, a.at - sent.pop(a.seq)))
    if not replies:
        raise TimeoutError(f"the device answered none of {probes} probe observations")
    angles = np.array([t for t, _ in replies]) % period / period * 2 * np.pi
    reply_phase = float(np.angle(np.exp(1j * angles).mean()) % (2 * np.pi) / (2 * np.pi) * period)
    min_rtt = min(r for _, r in replies)
    return Phase(reply_phase_s=reply_phase, min_rtt_s=min_rtt, send_phase_s=(reply_phase - min_rtt - lead_s) % period,
                 probes_sent=probes, probes_answered=len(replies))
