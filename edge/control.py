"""``sim2edge-agent run``: the control loop, at the bundle's rate, over a local datagram socket.

Every control period (``control.period_s`` of the active bundle) the loop takes the newest
observation that arrived since the last tick, computes ``Policy.act`` (limits clamped, NaN/Inf
guard) and sends the action back to the observation's sender. With no observation for
``watchdog_periods`` periods it sends the safe default action (flag WATCHDOG) every period.

Wire format (UDP ``udp://HOST:PORT`` or a Unix datagram socket ``unix:///path``), little-endian:

    observation  client → agent   "<4sIdI" + count × float32
        magic   b"S2O1"
        seq     uint32   sender's sequence number, echoed in the action
        stamp   float64  sender's clock, echoed unchanged (round-trip timing)
        count   uint32   number of float32 values; must equal the bundle's observation size
        values  count × float32, in the bundle's observation order (``io.input.terms``)
      optional tail: the robot's measured joint state, recorded in telemetry, never given to the policy
        nstate  uint32   number of float32 values (qpos then qvel in the MJCF's order); the same in
                         every observation of a run (the first one fixes it)
        state   nstate × float32

    action       agent → client   "<4sIdII" + count × float32
        magic   b"S2A1"
        seq     uint32   seq of the observation this answers (last seen one for WATCHDOG)
        stamp   float64  that observation's stamp
        flags   uint32   1 SAFE_DEFAULT: non-finite observation or action, default emitted (counted)
                         2 WATCHDOG: no observation for K periods, default emitted
                         4 LATE: this period's deadline was missed
                         8 FRESH: one of the first FRESH_ACTIONS (10) actions this agent process sent; a
                           FRESH action answering a newer observation than a settled one tells a restart
        count   uint32   number of float32 values (the bundle's action size)
        values  count × float32, in the bundle's action order (``io.output.terms``), within limits

    stats request   b"S2S1" (4 bytes)  → reply b"S2S1" + UTF-8 JSON of :meth:`ControlLoop.stats`

Datagrams that match neither format, or carry the wrong count, are dropped and counted.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Deque, Optional, Tuple

import numpy as np

from edge.policy import Policy
from edge.telemetry import Recorder

OBS = struct.Struct("<4sIdI")
ACT = struct.Struct("<4sIdII")
COUNT = struct.Struct("<I")
OBS_MAGIC, ACT_MAGIC, STATS_MAGIC = b"S2O1", b"S2A1", b"S2S1"
SAFE_DEFAULT, WATCHDOG, LATE, FRESH = 1, 2, 4, 8
FRESH_ACTIONS = 10


def open_socket(address: str) -> Tuple[socket.socket, str]:
    """Bind ``udp://host:port`` or ``unix:///path``; returns the socket and the bound address."""
    if address.startswith("udp://"):
        host, _, port = address[6:].rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host or "127.0.0.1", int(port)))
        bound = "udp://%s:%d" % sock.getsockname()
    elif address.startswith("unix://"):
        path = address[7:]
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        bound = address
    else:
        raise ValueError(f"listen address {address!r} must be udp://HOST:PORT or unix:///PATH")
    sock.setblocking(False)
    return sock, bound


def encode_observation(seq: int, stamp: float, values: np.ndarray, state: Optional[np.ndarray] = None) -> bytes:
    v = np.ascontiguousarray(values, dtype="<f4")
    tail = b"" if state is None else COUNT.pack(np.size(state)) + np.ascontiguousarray(state, dtype="<f4").tobytes()
    return OBS.pack(OBS_MAGIC, seq, stamp, v.size) + v.tobytes() + tail


def decode_action(data: bytes) -> Tuple[int, float, int, np.ndarray]:
    """An action datagram → (seq, stamp, flags, values)."""
    magic, seq, stamp, flags, count = ACT.unpack_from(data)
    if magic != ACT_MAGIC or len(data) != ACT.size + 4 * count:
        raise ValueError(f"not an action datagram ({len(data)} bytes, magic {magic!r})")
    return seq, stamp, flags, np.frombuffer(data, "<f4", count, ACT.size)


Observation = Tuple[int, float, np.ndarray, Optional[np.ndarray]]
"""seq, stamp, the policy's input values, the robot's joint state (telemetry only) or None."""


class ControlLoop:
    """Ticks at ``policy.period_s``; see the module docstring for the protocol.

    The transport is ``_receive`` (newest observation since the last tick) and ``_send`` (an action);
    edge/ros2.py overrides both, everything else (guard, watchdog, deadlines, stats) is shared."""

    def __init__(self, policy: Policy, sock: Optional[socket.socket], watchdog_periods: int = 5,
                 stop_after_silence_s: Optional[float] = None, recorder: Optional[Recorder] = None,
                 stats_window: int = 10000) -> None:
        self.policy, self.sock, self.recorder = policy, sock, recorder
        self.episode, self.step, self._last_tick = 0, 0, 0.0
        self.period = policy.period_s
        self.watchdog_periods = watchdog_periods
        self.stop_after_silence_s = stop_after_silence_s
        self.n_obs = len(policy.obs_names)
        self.nstate: Optional[int] = None  # joint-state values per observation, once a client sent them
        self.default = policy.default.astype("<f4")
        self.client = None
        self.last_seq, self.last_stamp = 0xFFFFFFFF, 0.0
        self.silent = 0
        self.counts = dict(ticks=0, observations=0, actions=0, safe_default=0, watchdog_trips=0,
                           watchdog_actions=0, malformed=0, deadline_misses=0, skipped_periods=0, dropped_stale=0)
        # the last ``stats_window`` samples: memory stays bounded however long the loop runs
        self.act_times: Deque[float] = deque(maxlen=stats_window)
        self.lateness: Deque[float] = deque(maxlen=stats_window)
        self._samples = threading.Lock()  # stats() may run on the reporting thread
        self._stop = threading.Event()
        self._started: Optional[float] = None

    def stop(self, *_args: object) -> None:
        self._stop.set()

    def _sample(self, samples: Deque[float], value: float) -> None:
        with self._samples:
            samples.append(value)

    def stats(self) -> dict:
        """Counters since start, the policy serving (name, version, its graph's sha256 as the signed manifest lists
        it) and its runtime (name, providers), and act() and wake-up lateness percentiles (µs) over the last window."""
        with self._samples:
            act, late = list(self.act_times), list(self.lateness)
            counts = dict(self.counts)

        def pct(xs: list, q: float) -> Optional[float]:
            return round(float(np.percentile(xs, q)) * 1e6, 1) if xs else None

        m = self.policy.manifest["policy"]
        return dict(counts, policy=m["name"], version=str(m["version"]), period_s=self.period, window=len(act),
                    graph_sha256=self.policy.manifest["files"]["policy.onnx"]["sha256"],
                    runtime=self.policy.runtime.name, providers=list(self.policy.runtime.providers),
                    watchdog=self.silent >= self.watchdog_periods,
                    uptime_s=round(time.monotonic() - self._started, 3) if self._started else 0.0,
                    act_p50_us=pct(act, 50), act_p99_us=pct(act, 99), wake_late_p99_us=pct(late, 99),
                    telemetry_files=self.recorder.files_written if self.recorder else 0,
                    telemetry_rows_dropped=self.recorder.rows_dropped if self.recorder else 0,
                    telemetry_write_errors=self.recorder.write_errors if self.recorder else 0)

    def _drain(self) -> Optional[Tuple[bytes, object]]:
        """Read every pending datagram; answer stats requests; return the newest valid observation."""
        newest = None
        while True:
            try:
                data, addr = self.sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return newest
            if data == STATS_MAGIC:
                if addr:
                    self.sock.sendto(STATS_MAGIC + json.dumps(self.stats()).encode(), addr)
                continue
            if len(data) < OBS.size or data[:4] != OBS_MAGIC:
                self.counts["malformed"] += 1
                continue
            count = OBS.unpack_from(data)[3]
            end = OBS.size + 4 * count
            nstate = COUNT.unpack_from(data, end)[0] if len(data) >= end + COUNT.size else None
            if count != self.n_obs or len(data) != end + (0 if nstate is None else COUNT.size + 4 * nstate) \
                    or (nstate is not None and self.nstate not in (None, nstate)):
                self.counts["malformed"] += 1
                continue
            if nstate is not None:
                self.nstate = nstate
            if newest is not None:
                self.counts["dropped_stale"] += 1  # two observations in one period: the older is skipped
            newest = (data, addr)

    def _receive(self) -> Optional[Observation]:
        """The newest valid observation datagram since the last tick; its sender gets the replies."""
        got = self._drain()
        if got is None:
            return None
        data, addr = got
        self.client = addr or self.client
        _, seq, stamp, count = OBS.unpack_from(data)
        obs = np.frombuffer(data, "<f4", count, OBS.size)
        tail = OBS.size + 4 * count + COUNT.size
        state = np.frombuffer(data, "<f4", self.nstate, tail) if len(data) > tail else None
        return seq, stamp, obs, state

    def _send(self, seq: int, stamp: float, flags: int, action: np.ndarray) -> None:
        if self.client is None:
            return
        if self.counts["actions"] < FRESH_ACTIONS:
            flags |= FRESH
        try:
            self.sock.sendto(ACT.pack(ACT_MAGIC, seq, stamp, flags, action.size) + action.astype("<f4").tobytes(),
                             self.client)
            self.counts["actions"] += 1
        except OSError:
            pass  # the client went away; the watchdog takes over

    def tick(self, deadline: float) -> None:
        """One control period: newest observation → action, or the watchdog's default."""
        self.counts["ticks"] += 1
        now = time.monotonic()
        loop_s, self._last_tick = (now - self._last_tick if self._last_tick else 0.0), now
        got = self._receive()
        flags = 0
        if got is not None:
            seq, stamp, obs, state = got
            self.counts["observations"] += 1
            self.silent = 0
            before = self.policy.unsafe_count
            start = time.perf_counter()
            action = self.policy.act(obs)
            act_s = time.perf_counter() - start
            self._sample(self.act_times, act_s)
            if self.policy.unsafe_count != before:
                flags |= SAFE_DEFAULT
                self.counts["safe_default"] += 1
            self.last_seq, self.last_stamp = seq, stamp
        else:
            self.silent += 1
            if self.silent < self.watchdog_periods:
                return
            if self.silent == self.watchdog_periods:
                self.counts["watchdog_trips"] += 1
                self.episode, self.step = self.episode + 1, 0  # telemetry: a new episode after silence
            flags |= WATCHDOG
            self.counts["watchdog_actions"] += 1
            action = self.default
        if time.monotonic() > deadline:
            flags |= LATE
            self.counts["deadline_misses"] += 1
        self._send(self.last_seq, self.last_stamp, flags, action)
        if got is not None and self.recorder is not None:
            self.recorder.record(self.episode, self.step, time.time(), obs, action, act_s, loop_s, flags, state)
            self.step += 1

    def serve(self, duration_s: Optional[float] = None) -> dict:
        """Run until stopped (SIGTERM/SIGINT), ``duration_s`` elapsed, or the silence limit; return stats."""
        start = next_tick = self._started = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if duration_s is not None and now - start >= duration_s:
                break
            if now < next_tick:
                time.sleep(next_tick - now)
                now = time.monotonic()
            self._sample(self.lateness, now - next_tick)
            if now - next_tick > self.period:
                # woke up more than a period late: count the periods lost, re-anchor instead of bursting
                lost = int((now - next_tick) / self.period)
                self.counts["skipped_periods"] += lost
                self.counts["deadline_misses"] += lost
                next_tick += lost * self.period
            self.tick(next_tick + self.period)
            next_tick += self.period
            if self.stop_after_silence_s is not None and self.silent * self.period >= self.stop_after_silence_s:
                break
        if self.recorder is not None:
            self.recorder.flush()
        return self.stats()


@dataclass(frozen=True)
class ReportTo:
    """Where ``run`` reports its statistics (edge/report.py, tag ``sim2edge.control.<device_id>``)."""

    registry_url: str
    device_id: str
    every_s: float = 60.0
    timeout_s: float = 5.0
    backoff_base_s: float = 30.0


def recorder_for(root: Path, policy: Policy, telemetry: Optional[dict]) -> Optional[Recorder]:
    """The telemetry recorder of ``run`` and ``ros2`` (None: not recording)."""
    if telemetry is None:
        return None
    return Recorder(root, policy.obs_names, policy.action_names, str(policy.manifest["policy"]["version"]),
                    command_names=policy.command_names, **telemetry)


def report_periodically(loop: ControlLoop, root: Path, to: ReportTo) -> threading.Thread:
    """A daemon thread posting ``loop.stats()`` every ``to.every_s`` and once more when the loop stops."""
    from edge.report import control_reporter

    reporter = control_reporter(root, to.registry_url, loop.policy.manifest["policy"]["name"], to.device_id,
                                loop.stats, to.timeout_s, to.backoff_base_s)

    def report() -> None:
        while not loop._stop.wait(to.every_s):
            reporter.report()
        reporter.report()

    thread = threading.Thread(target=report, name="sim2edge-report", daemon=True)
    thread.start()
    return thread


def run(root: Path, listen: str, watchdog_periods: int = 5, duration_s: Optional[float] = None,
        stop_after_silence_s: Optional[float] = None, stats_path: Optional[Path] = None,
        telemetry: Optional[dict] = None, report: Optional[ReportTo] = None, stats_window: int = 10000) -> dict:
    """Serve the active policy of the store at ``root`` on ``listen`` (the CLI's ``run``).

    ``telemetry``: ``Recorder`` keyword arguments (``device_id``, ``rows_per_file``, ``cap_bytes``) to record;
    ``report``: post the statistics to the registry periodically, never blocking the loop."""
    policy = Policy.load(root)
    sock, bound = open_socket(listen)
    loop = ControlLoop(policy, sock, watchdog_periods, stop_after_silence_s, recorder_for(root, policy, telemetry),
                       stats_window)
    signal.signal(signal.SIGTERM, loop.stop)
    signal.signal(signal.SIGINT, loop.stop)
    reporting = report_periodically(loop, root, report) if report is not None else None
    m = policy.manifest["policy"]
    print(f"serving {m['name']} v{m['version']} on {bound} every {policy.period_s * 1e3:g} ms "
          f"({policy.runtime.name}, watchdog after {watchdog_periods} periods)", flush=True)
    try:
        stats = loop.serve(duration_s)
    finally:
        loop.stop()
        sock.close()
        if listen.startswith("unix://") and os.path.exists(listen[7:]):
            os.unlink(listen[7:])
    if reporting is not None:
        reporting.join(report.timeout_s + 1.0)  # the final report, one short attempt
    if stats_path is not None:
        stats_path.write_text(json.dumps(stats, sort_keys=True))
    return stats
