"""rosbag2 ingest throughput: ``bag_logs.convert`` (read, deserialize, match joints by name, resample, write Parquet)
against rosbags' own read rate of the same bag, measured in the same run.

Bag: 60 s of cart-pole joint states at 500 Hz (shuffled joint order) and Float64MultiArray commands at the control
rate (50 Hz), in MCAP and SQLite3 storage.   Run: .venv/bin/python benchmarks/ingest_rosbag.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from rosbags.rosbag2 import Reader, StoragePlugin, Writer

from stages.collect import bag_logs
from stages.collect.bag_mapping import BagMapping
from stages.collect.bag_reader import TYPESTORE
from stages.sim.registry import load

SECONDS, STATE_HZ, CMD_HZ = 60, 500, 50
JS, CMD = "/joint_states", "/commands"
MAPPING = BagMapping.model_validate(yaml.safe_load(f"""
joint_state: {{topic: {JS}, max_age_s: 0.03}}
commands: {{topic: {CMD}, names: [slide], max_age_s: 0.03}}
episodes: {{gap_s: 0.5}}
"""))


def write(path: Path, storage: StoragePlugin) -> int:
    T, rng, start, count = TYPESTORE.types, np.random.default_rng(0), 10**18, 0
    messages = []
    for k in range(SECONDS * STATE_HZ):
        t = start + k * 10**9 // STATE_HZ
        order = rng.permutation(2)
        msg = T["sensor_msgs/msg/JointState"](
            header=T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=t // 10**9, nanosec=t % 10**9),
                                            frame_id=""),
            name=list(np.array(["slider", "hinge"])[order]), position=rng.normal(size=2), velocity=rng.normal(size=2),
            effort=np.zeros(0))
        messages.append((JS, t, bytes(TYPESTORE.serialize_cdr(msg, "sensor_msgs/msg/JointState"))))
    for k in range(SECONDS * CMD_HZ + 1):  # one past the last tick: its period's command
        msg = T["std_msgs/msg/Float64MultiArray"](layout=T["std_msgs/msg/MultiArrayLayout"](dim=[], data_offset=0),
                                                  data=rng.uniform(-1, 1, 1))
        messages.append((CMD, start + k * 10**9 // CMD_HZ + 10**6,
                         bytes(TYPESTORE.serialize_cdr(msg, "std_msgs/msg/Float64MultiArray"))))
    with Writer(path, version=9, storage_plugin=storage) as writer:
        conns = {JS: writer.add_connection(JS, "sensor_msgs/msg/JointState", typestore=TYPESTORE),
                 CMD: writer.add_connection(CMD, "std_msgs/msg/Float64MultiArray", typestore=TYPESTORE)}
        for topic, t, raw in sorted(messages, key=lambda m: m[1]):
            writer.write(conns[topic], t, raw)
            count += 1
    return count


def rate(count: int, fn) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return count / best


def main() -> None:
    task = load("cartpole")
    for storage in (StoragePlugin.MCAP, StoragePlugin.SQLITE3):
        with tempfile.TemporaryDirectory() as tmp:
            bag = Path(tmp) / "bag"
            count = write(bag, storage)

            def raw_read() -> None:
                with Reader(bag) as reader:
                    for _ in reader.messages():
                        pass

            def rosbags_deserialize() -> None:
                with Reader(bag) as reader:
                    for conn, _, raw in reader.messages():
                        TYPESTORE.deserialize_cdr(raw, conn.msgtype)

            def ingest() -> None:
                out = Path(tmp) / "out"
                out.mkdir(exist_ok=True)
                logs = bag_logs.convert(bag, MAPPING, task, out)
                assert logs.log is not None and not logs.refused, logs.refused

            r, d, i = rate(count, raw_read), rate(count, rosbags_deserialize), rate(count, ingest)
            print(f"{storage.name:8s} {count} messages: rosbags raw read {r:,.0f} msg/s, rosbags read+deserialize "
                  f"{d:,.0f} msg/s, sim2edge ingest (convert to log) {i:,.0f} msg/s = {i / r:.2f}x raw, {i / d:.2f}x "
                  f"read+deserialize")


if __name__ == "__main__":
    main()
