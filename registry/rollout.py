"""A staged rollout as a state machine: rings in order, each judged on its devices' state reports.

The reference is AWS IoT Greengrass v2's deployment job (abort criteria: a failure-percentage threshold
once a minimum number of devices executed; roll back on failure) and Mender's phased deployments.
:func:`judge` is pure: state and reports in, state out. The flow (flows/rollout.py) reads the reports
(registry/fleet_state.py), publishes :func:`plan` as the signed ``rollout.json`` devices follow
(edge/rollout_plan.py) and saves the state after every step, so a crashed flow resumes where it was
and writes the same plan again instead of promoting twice.

A device of the current ring (its ring from its labels and id, registry/rings.py) is
- **succeeded** when it reports the new version with health ``ok``;
- **failed** when it refused the new version (its ``last_refusal``), rolled back from it after a failed
  health check, or reports it ``corrupt``;
- **timed out** when neither, ``ring_timeout_s`` after its ring started.
The ring **halts** — its devices go back to the previous version, the rollout stops — as soon as at
least ``min_devices`` (or every device of the ring known so far) have succeeded, failed or timed out and more than
``abort_failed_percent`` of those did not succeed. A ring whose devices have all executed, at most that share of
them failed or timed out, soaks for ``soak_s`` (failures still count) and then passes; the next ring starts (as a
Greengrass job completes below its abort threshold: one slow device among 171 must not hold the fleet back). A ring
no device of which has reported has executed nothing, so it is never judged: it holds (``rolling``, its reason saying
so) rather than passing an empty soak. ``abort`` sends every ring back to the previous version.

With a **rollout rate** (Greengrass's exponential rate: ``rate_base_per_min`` devices in the ring's first minute,
each later minute ``rate_increment_factor`` times the one before) a ring's devices get the version in their
admission order (edge/rollout_plan.py's ``admission_bucket``, a second hash of the id): after ``m`` whole minutes
``base * (1 + f + … + f^m)`` devices are due, and the plan's ``admitted`` share of the ring is the bucket of the
first device not yet due among the ring's devices known from their reports (100 once every known one is due). The
count is exact for known devices; one not yet reported falls in whatever share that is, so a ring whose devices
have not all reported goes faster than the rate. No known device: nothing is admitted, the ring holds (as above).
Only admitted devices are judged, each timing out ``ring_timeout_s`` after it was admitted, so failures among the
first admitted halt the ring before the rest get the version; a ring soaks only once its admission reached 100. The
share never shrinks; the rate's clock runs from the ring's start and stops while the rollout is paused (resuming
moves the ring's start by the pause), so a resume admits no more than the rate would have. Without a rate every
device is admitted when its ring starts."""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edge.rollout_plan import admission_bucket
from registry.fleet_state import DeviceReport
from registry.rings import RingSpec, ring_of

RingStatus = Literal["waiting", "rolling", "soaking", "passed", "halted"]
Status = Literal["running", "paused", "halted", "done", "aborted"]
ENDED = ("halted", "done", "aborted")
SHOWN_DEVICES = 10


class RolloutConfig(BaseModel):
    """What to roll out, to which rings, and when to stop."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    policy: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    version: str = Field(pattern=r"^[1-9][0-9]{0,9}$", description="The version rolled out.")
    previous: Optional[str] = Field(None, pattern=r"^[1-9][0-9]{0,9}$",
                                    description="The version devices go back to (None: nothing before it).")
    rings: RingSpec
    abort_failed_percent: float = Field(5.0, ge=0, le=100)
    min_devices: int = Field(1, ge=1, description="Devices of a ring that must have executed before it is judged.")
    soak_s: float = Field(60.0, ge=0, description="How long a ring whose devices all executed is watched.")
    ring_timeout_s: float = Field(900.0, gt=0, description="A device not on the version by then has timed out.")
    rate_base_per_min: Optional[int] = Field(None, ge=1, le=1000,
                                             description="Devices of a ring admitted in its first minute (None: all).")
    rate_increment_factor: Optional[float] = Field(None, ge=1, le=5,
                                                   description="Each minute's admissions over the last's (default 1).")

    @model_validator(mode="after")
    def _rate(self) -> "RolloutConfig":
        if self.rate_increment_factor is not None and self.rate_base_per_min is None:
            raise ValueError("rate_increment_factor needs rate_base_per_min")
        return self

    def due(self, elapsed_s: float) -> float:
        """Devices of a ring due ``elapsed_s`` after it started: ``base * (1 + f + … + f^m)``, m whole minutes."""
        if self.rate_base_per_min is None:
            return math.inf
        m, f = int(max(elapsed_s, 0) // 60), self.rate_increment_factor or 1.0
        try:
            return self.rate_base_per_min * ((m + 1) if f == 1 else (f ** (m + 1) - 1) / (f - 1))
        except OverflowError:
            return math.inf


class RingProgress(BaseModel):
    """One ring's standing at the last judgement."""

    name: str
    status: RingStatus = "waiting"
    started: Optional[float] = None
    soak_started: Optional[float] = None
    devices: int = 0
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    failed_devices: list[str] = []
    reason: str = ""
    admitted: float = Field(100.0, ge=0, le=100, description="Share of the ring's devices sent the version so far.")
    admissions: list[tuple[float, float]] = Field(
        [], description="(time, admitted) each time the share grew: when each device was admitted.")


class RolloutState(BaseModel):
    """The rollout as saved between steps."""

    config: RolloutConfig
    status: Status = "running"
    ring: int = 0
    rings: list[RingProgress]
    reason: str = ""
    published: Optional[dict] = Field(None, description="The last plan written to the repository.")
    paused_at: Optional[float] = Field(None, description="When the operator paused it (None: not paused).")

    @property
    def ended(self) -> bool:
        return self.status in ENDED


def start(config: RolloutConfig, now: float) -> RolloutState:
    """A new rollout: its first ring rolling."""
    rings = [RingProgress(name=r.name) for r in config.rings.rings]
    rings[0] = _begin(rings[0], config, now)
    return RolloutState(config=config, rings=rings)


def _begin(ring: RingProgress, cfg: RolloutConfig, now: float) -> RingProgress:
    return ring.model_copy(update={"status": "rolling", "started": now,
                                   "admitted": 100.0 if cfg.rate_base_per_min is None else 0.0})


def _admitted_at(progress: RingProgress, device: str) -> Optional[float]:
    """When the device was admitted to its ring's version (None: not yet)."""
    b = admission_bucket(device)
    if b >= progress.admitted:
        return None
    return next((t for t, share in progress.admissions if b < share), progress.started)


def _admit(progress: RingProgress, known: list[str], cfg: RolloutConfig, now: float) -> RingProgress:
    """The ring with its admitted share grown to the devices due now (see the module docstring)."""
    order = sorted(admission_bucket(d) for d in known)
    due = cfg.due(now - (now if progress.started is None else progress.started))
    share = 0.0 if not order else 100.0 if due >= len(order) else order[int(due)]
    if share <= progress.admitted:
        return progress
    return progress.model_copy(update={"admitted": share, "admissions": [*progress.admissions, (now, share)]})


def _outcome(report: DeviceReport, cfg: RolloutConfig, started: Optional[float], now: float) -> str:
    """``succeeded``, ``failed``, ``timed_out`` or ``pending`` for one device of the current ring admitted at
    ``started`` (None: not admitted, so ``waiting``)."""
    if started is None:
        return "waiting"
    refusal, error = report.last_refusal or {}, report.last_error or {}
    if (str(refusal.get("policy")), str(refusal.get("version"))) == (cfg.policy, cfg.version) and \
            float(refusal.get("time") or 0) >= started:
        return "failed"
    if report.health == "rolled-back" and str(error.get("version")) == cfg.version:
        return "failed"
    if (report.policy, report.version) == (cfg.policy, cfg.version):
        return "succeeded" if report.health == "ok" else "failed"
    return "timed_out" if now - started >= cfg.ring_timeout_s else "pending"


def _mine(progress: RingProgress, reports: list[DeviceReport], cfg: RolloutConfig) -> list[DeviceReport]:
    return [r for r in reports if r.policy in (cfg.policy, None)
            and ring_of(r.device, r.labels, cfg.rings) == progress.name]


def _count(progress: RingProgress, mine: list[DeviceReport], cfg: RolloutConfig, now: float) -> RingProgress:
    outcomes = {r.device: _outcome(r, cfg, _admitted_at(progress, r.device), now) for r in mine}
    failed = sorted(d for d, o in outcomes.items() if o == "failed")
    return progress.model_copy(update={
        "devices": len(mine), "succeeded": sum(o == "succeeded" for o in outcomes.values()), "failed": len(failed),
        "timed_out": sum(o == "timed_out" for o in outcomes.values()), "failed_devices": failed[:SHOWN_DEVICES]})


def judge(state: RolloutState, reports: list[DeviceReport], now: float) -> RolloutState:
    """The rollout after looking at ``reports`` at time ``now`` (see the module docstring)."""
    if state.ended or state.status == "paused":
        return state
    cfg, rings = state.config, list(state.rings)
    mine = _mine(rings[state.ring], reports, cfg)
    ring = _count(rings[state.ring], mine, cfg, now)
    executed = ring.succeeded + ring.failed + ring.timed_out
    bad = ring.failed + ring.timed_out
    judged = executed >= cfg.min_devices or (executed and executed == ring.devices)
    if judged and 100 * bad / executed > cfg.abort_failed_percent:
        why = (f"ring {ring.name}: {bad} of {executed} devices failed or timed out "
               f"(threshold {cfg.abort_failed_percent:g}%): {', '.join(ring.failed_devices) or 'timed out'}")
        rings[state.ring] = ring.model_copy(update={"status": "halted", "reason": why})
        return state.model_copy(update={"rings": rings, "status": "halted", "reason": why})
    if not ring.devices:  # nothing executed, so nothing judged (min_devices): an empty ring never passes
        why = (f"ring {ring.name}: no device of this ring has reported, so it is not judged and does not pass "
               f"its soak; holding until one reports (or abort the rollout)")
        rings[state.ring] = ring.model_copy(update={"status": "rolling", "soak_started": None, "reason": why})
        return state.model_copy(update={"rings": rings, "reason": why})
    ring, state = ring.model_copy(update={"reason": ""}), state.model_copy(update={"reason": ""})  # not held now
    ring = _admit(ring, [r.device for r in mine], cfg, now)
    if executed < ring.devices:  # also while admission is below 100: some known device is not admitted yet
        rings[state.ring] = ring
        return state.model_copy(update={"rings": rings})
    soak_started = ring.soak_started if ring.soak_started is not None else now
    if now - soak_started < cfg.soak_s:
        rings[state.ring] = ring.model_copy(update={"status": "soaking", "soak_started": soak_started})
        return state.model_copy(update={"rings": rings})
    rings[state.ring] = ring.model_copy(update={"status": "passed", "soak_started": soak_started})
    if state.ring + 1 == len(rings):
        return state.model_copy(update={"rings": rings, "status": "done", "reason": "every ring passed"})
    rings[state.ring + 1] = _begin(rings[state.ring + 1], cfg, now)
    return state.model_copy(update={"rings": rings, "ring": state.ring + 1})


def control(state: RolloutState, command: str, now: float) -> RolloutState:
    """``pause``, ``resume`` or ``abort`` applied at ``now`` (an ended rollout stays as it is). Resuming moves the
    current ring's start by the time it was paused: the rate's clock does not run while paused."""
    if state.ended:
        return state
    if command == "pause":
        if state.status == "paused":
            return state
        return state.model_copy(update={"status": "paused", "reason": "paused by the operator", "paused_at": now})
    if command == "resume":
        rings, ring = list(state.rings), state.rings[state.ring]
        if state.paused_at is not None and ring.started is not None:
            rings[state.ring] = ring.model_copy(update={"started": ring.started + max(now - state.paused_at, 0.0)})
        return state.model_copy(update={"status": "running", "reason": "", "paused_at": None, "rings": rings})
    if command == "abort":
        return state.model_copy(update={"status": "aborted", "reason": "aborted by the operator"})
    raise ValueError(f"rollout command {command!r}: expected pause, resume or abort")


def plan(state: RolloutState) -> dict:
    """The ``rollout.json`` devices follow (edge/rollout_plan.py): the new version for every ring that started and
    has not halted (to its admitted share under a rate: the others and devices in no ring run ``default``); the
    previous one elsewhere (everywhere once aborted); devices in no ring move when it is done."""
    cfg = state.config
    new = {"rolling", "soaking", "passed"} if state.status != "aborted" else set()
    rings = [{"name": r.name, "match": dict(r.match), "percent": r.percent,
              "version": cfg.version if p.status in new else cfg.previous,
              **({} if cfg.rate_base_per_min is None else {"admitted": p.admitted})}
             for r, p in zip(cfg.rings.rings, state.rings)]
    return {"policy": cfg.policy, "rings": rings, "default": cfg.version if state.status == "done" else cfg.previous}
