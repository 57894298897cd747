"""A fleet's device states from the MQTT broker: the retained messages ``sim2edge-agent --report
mqtt://…`` publishes on ``sim2edge/<fleet>/<device id>/state`` (edge/mqtt_report.py), each validated
into a :class:`DeviceReport`. A message that does not validate is counted and named in
:attr:`FleetState.malformed` (topic and reason), never raised."""

from __future__ import annotations

import json
import threading
import time
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge.mqtt_report import NAME, Broker, parse_broker
from registry.rings import check_labels

MAX_BYTES = 64 << 10


class DeviceReport(BaseModel):
    """One device's last state as the agent sent it (edge/report.py ``device_state`` plus fleet and labels)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    fleet: str = Field(pattern=NAME.pattern)
    device: str = Field(pattern=NAME.pattern)
    hostname: Optional[str] = Field(None, max_length=255)
    policy: Optional[str] = Field(None, max_length=200)
    version: Optional[str] = Field(None, max_length=64)
    health: Literal["ok", "corrupt", "rolled-back", "none"]
    runtime: Optional[str] = Field(None, max_length=200)
    last_error: Optional[dict] = None
    last_refusal: Optional[dict] = None
    pull_failures: int = Field(ge=0)
    missed_reports: int = Field(ge=0)
    labels: dict[str, str] = {}
    time: float = Field(gt=0)

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        return check_labels(labels)


class Malformed(BaseModel):
    """A retained message that is not a device state: its topic and why."""

    model_config = ConfigDict(frozen=True)
    topic: str
    reason: str


class FleetState(BaseModel):
    """What the broker holds for one fleet, devices sorted by id."""

    model_config = ConfigDict(frozen=True)
    fleet: str
    devices: list[DeviceReport]
    malformed: list[Malformed]


def parse(fleet: str, topic: str, payload: bytes) -> DeviceReport:
    """``payload`` from ``topic`` as a device report of ``fleet``; ``ValueError`` naming the first bad field."""
    parts = topic.split("/")
    if len(parts) != 4 or parts[:2] != ["sim2edge", fleet] or parts[3] != "state":
        raise ValueError(f"topic is not sim2edge/{fleet}/<device id>/state")
    if len(payload) > MAX_BYTES:
        raise ValueError(f"{len(payload)} bytes, more than {MAX_BYTES}")
    try:
        state = json.loads(payload)
        report = DeviceReport.model_validate(state)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"field {'.'.join(map(str, err['loc'])) or '(root)'}: {err['msg']}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON ({str(e)[:100]})") from None
    if (report.fleet, report.device) != (fleet, parts[2]):
        raise ValueError(f"says fleet {report.fleet!r} device {report.device!r}, but its topic is {topic}")
    return report


def read_fleet(broker: str | Broker, fleet: str, user: str, password: str, timeout_s: float = 10.0,
               settle_s: float = 0.5) -> FleetState:
    """Subscribe to ``sim2edge/<fleet>/+/state`` as ``user`` and collect the retained messages until the first live
    one (the broker sends the retained ones when the subscription starts, flagged as such, and live ones after, not
    flagged: a busy fleet's reports never leave ``settle_s`` of quiet) or until none arrived for ``settle_s`` (at
    most ``timeout_s``). ``OSError`` when the broker is unreachable or refuses ``user``."""
    import paho.mqtt.client as mqtt

    if not NAME.fullmatch(fleet):
        raise ValueError(f"fleet {fleet!r}: expected 1-128 characters [A-Za-z0-9_.-]")
    b = parse_broker(broker) if isinstance(broker, str) else broker
    messages: dict[str, bytes] = {}
    subscribed, live, refusal, last = threading.Event(), threading.Event(), [], [time.monotonic()]

    def on_connect(c, userdata, flags, reason, properties) -> None:
        if reason.is_failure:
            refusal.append(str(reason))
            subscribed.set()
        else:
            c.subscribe(f"sim2edge/{fleet}/+/state", qos=1)

    def on_subscribe(c, userdata, mid, reasons, properties) -> None:
        last[0] = time.monotonic()
        subscribed.set()

    def on_message(c, userdata, msg) -> None:
        if msg.payload:  # empty: a cleared retained message
            messages[msg.topic] = msg.payload
        last[0] = time.monotonic()
        if not msg.retain:
            live.set()

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    client.username_pw_set(user, password)
    client.connect_timeout = timeout_s
    if b.tls:
        client.tls_set(ca_certs=b.ca)
    client.on_connect, client.on_subscribe, client.on_message = on_connect, on_subscribe, on_message
    start = time.monotonic()
    client.connect(b.host, b.port, keepalive=max(5, int(timeout_s)))
    client.loop_start()
    try:
        if not subscribed.wait(timeout_s) or refusal:
            raise OSError(f"broker {b.host}:{b.port} refused {user!r}: "
                          f"{refusal[0] if refusal else 'no answer within %.0f s' % timeout_s}")
        while not live.is_set() and time.monotonic() - last[0] < settle_s and time.monotonic() - start < timeout_s:
            time.sleep(0.05)
    finally:
        client.disconnect()
        client.loop_stop()
    reports, malformed = [], []
    for topic, payload in sorted(messages.items()):
        try:
            reports.append(parse(fleet, topic, payload))
        except ValueError as e:
            malformed.append(Malformed(topic=topic, reason=str(e)))
    return FleetState(fleet=fleet, devices=sorted(reports, key=lambda r: r.device), malformed=malformed)
