"""The device's state over MQTT: ``pull`` and ``watch`` with ``--report mqtt://HOST:PORT`` publish
:func:`edge.report.device_state` (plus ``fleet`` and ``labels``) as one retained JSON message, QoS 1,
on ``sim2edge/<fleet>/<device id>/state``, so a subscriber (registry/fleet_state.py) reads every
device's last state the moment it subscribes.

Auth: MQTT user name = device id; the password comes from ``--mqtt-password-file`` or the
``SIM2EDGE_MQTT_PASSWORD`` variable, never from the command line. The broker's ACL
(``pattern readwrite sim2edge/+/%u/state``) lets a device write its own topic only: a device that
publishes under another id is dropped by the broker. ``mqtts://HOST:PORT`` connects with TLS
(``--mqtt-ca`` names the CA bundle; default: the system's).

A broker that is down or refuses never fails an install: the unsent report is queued in
``<root>/mqtt-report.json`` (one line on stderr says so) and the next ``pull`` or ``watch`` poll
with ``--report`` sends the device's state then — computed afresh, so it supersedes the queued one —
with ``missed_reports`` counting the reports that did not go out. Needs ``paho-mqtt`` (extra ``mqtt``)."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, NamedTuple, Optional
from urllib.parse import urlsplit

from edge.store import write_atomic

QUEUE = "mqtt-report.json"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
LABEL = re.compile(r"[a-z0-9_.-]{1,63}")


class Broker(NamedTuple):
    """Where and how to publish: ``mqtt://`` (plain) or ``mqtts://`` (TLS, CA bundle ``ca`` or the system's)."""

    host: str
    port: int
    tls: bool = False
    ca: Optional[str] = None


def parse_broker(url: str, ca: Optional[str] = None) -> Broker:
    """``mqtt://HOST[:PORT]`` (1883) or ``mqtts://HOST[:PORT]`` (8883)."""
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--report {url!r}: expected mqtt://HOST:PORT or mqtts://HOST:PORT")
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise ValueError(f"--report {url!r}: the port is not a number from 1 to 65535") from None
    return Broker(parts.hostname, port, tls, ca)


def parse_labels(pairs) -> Dict[str, str]:
    """``key=value`` strings into a dict; keys and values ``[a-z0-9_.-]``, 1-63 characters, keys unique."""
    labels: Dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not LABEL.fullmatch(key) or not LABEL.fullmatch(value):
            raise ValueError(f"--label {pair!r}: expected key=value, each of 1-63 characters [a-z0-9_.-]")
        if key in labels:
            raise ValueError(f"--label {pair!r}: key {key!r} given twice")
        labels[key] = value
    return labels


def topic(fleet: str, device_id: str) -> str:
    """``sim2edge/<fleet>/<device id>/state``; both names ``[A-Za-z0-9_.-]`` (no MQTT wildcards or levels)."""
    for what, name in (("fleet", fleet), ("device id", device_id)):
        if not NAME.fullmatch(name):
            raise ValueError(f"MQTT {what} {name!r}: expected 1-128 characters [A-Za-z0-9_.-]")
    return f"sim2edge/{fleet}/{device_id}/state"


def read_password(path: Optional[Path], env: Dict[str, str]) -> str:
    """The device's MQTT password: the first line of ``path``, else ``SIM2EDGE_MQTT_PASSWORD``."""
    password = (path.read_text().splitlines() or [""])[0] if path else env.get("SIM2EDGE_MQTT_PASSWORD", "")
    if not password:
        raise ValueError("--report mqtt:// needs a password: --mqtt-password-file PATH or SIM2EDGE_MQTT_PASSWORD")
    return password


def publish(broker: Broker, user: str, password: str, topic_: str, payload: bytes, timeout_s: float = 5.0) -> None:
    """One retained QoS 1 message, acknowledged by the broker within ``timeout_s``; raises ``OSError`` otherwise."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv311)
    client.username_pw_set(user, password)
    client.connect_timeout = timeout_s
    if broker.tls:
        client.tls_set(ca_certs=broker.ca)
    connected, refusal = threading.Event(), []

    def on_connect(c, userdata, flags, reason, properties) -> None:
        if reason.is_failure:
            refusal.append(str(reason))
        connected.set()

    client.on_connect = on_connect
    try:
        client.connect(broker.host, broker.port, keepalive=max(5, int(timeout_s * 2)))
        client.loop_start()
        if not connected.wait(timeout_s) or refusal:
            raise OSError(f"broker {broker.host}:{broker.port} refused {user!r}: "
                          f"{refusal[0] if refusal else 'no answer within %.0f s' % timeout_s}")
        info = client.publish(topic_, payload, qos=1, retain=True)
        info.wait_for_publish(timeout_s)
        if not info.is_published():
            raise OSError(f"broker {broker.host}:{broker.port} did not acknowledge {topic_} within {timeout_s:.0f} s")
    except (ValueError, RuntimeError) as e:  # paho: not connected, queue full
        raise OSError(f"broker {broker.host}:{broker.port}: {e}") from None
    finally:
        client.disconnect()
        client.loop_stop()


class MqttReporter:
    """Publishes ``state()`` with ``fleet`` and ``labels`` on the device's topic; queues it on failure."""

    def __init__(self, root: Path, broker: Broker, fleet: str, device_id: str, password: str,
                 labels: Dict[str, str], state: Callable[[], dict], timeout_s: float = 5.0) -> None:
        self.queue, self.broker, self.fleet, self.device_id = Path(root) / QUEUE, broker, fleet, device_id
        self.topic, self.password, self.labels, self.state, self.timeout_s = (
            topic(fleet, device_id), password, dict(labels), state, timeout_s)

    def report(self) -> Optional[dict]:
        """Send the current state now; returns it, or None when it was queued instead. Never raises."""
        try:
            queued = json.loads(self.queue.read_text()) if self.queue.exists() else {}
            missed = int(queued.get("missed", 0))
            state = dict(self.state(), fleet=self.fleet, labels=self.labels, missed_reports=missed)
            try:
                publish(self.broker, self.device_id, self.password, self.topic,
                        json.dumps(state, sort_keys=True).encode(), self.timeout_s)
            except OSError as e:
                write_atomic(self.queue, json.dumps({"missed": missed + 1, "error": str(e)[:300], "time": time.time(),
                                                     "report": state}, sort_keys=True).encode())
                print(f"state report to {self.broker.host}:{self.broker.port} queued ({e})", file=sys.stderr,
                      flush=True)
                return None
            self.queue.unlink(missing_ok=True)
            return state
        except Exception as e:  # a report must never stop the agent
            print(f"state report skipped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            return None
