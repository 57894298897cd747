"""The agent's run loop, telemetry recorder and bench under the oldest JetPack Python (3.8, JetPack 5)."""

from __future__ import annotations

import json
import signal
import subprocess

import numpy as np
import pytest

from edge.control import SAFE_DEFAULT
from tests.bundles import active_store
from tests.test_agent_run import Client
from tests.test_edge_pythons import edge_venv


@pytest.mark.device
def test_run_loop_and_bench_on_python38(tmp_path):
    venv = edge_venv("3.8")
    agent = str(venv / "bin" / "sim2edge-agent")
    root = active_store(tmp_path, period_s=0.01)
    proc = subprocess.Popen([agent, "run", "--root", str(root), "--listen", "udp://127.0.0.1:0", "--telemetry"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    line = proc.stdout.readline()
    try:
        assert line.startswith("serving tiny v1 on udp://"), line + proc.stderr.read()
        client = Client(line.split(" on ", 1)[1].split(" ")[0], tmp_path)
        assert client.act(1, np.full(5, 10.0))[3] == pytest.approx([0.8])
        seq, _, flags, action = client.act(2, np.array([np.nan, 0, 0, 0, 0], np.float32))
        assert flags & SAFE_DEFAULT and action == pytest.approx([0.1])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["safe_default"] == 1 and stats["telemetry_files"] == 1
    bench = subprocess.run([agent, "bench", "--root", str(root), "--iterations", "1000", "--json"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["act_p50_us"] > 0
    history = subprocess.run([agent, "history", "--root", str(root)], capture_output=True, text=True, cwd=tmp_path)
    assert history.returncode == 0


MCAP_WRITE = """
import sys, numpy as np
from pathlib import Path
from edge.telemetry import Recorder
r = Recorder(Path(sys.argv[1]), ["a", "g"], ["u"], "1", "dev", rows_per_file=3, format="mcap", command_names=["g"])
for i in range(5):
    r.record(0, i, 1.7e9 + i, np.array([i, 10 + i], np.float32), np.array([i / 2], np.float32), 1e-4, 0.02, 0,
             np.array([i, -i], np.float32))
r.flush()
"""


@pytest.mark.device
def test_mcap_telemetry_written_on_python38_reads_back_here(tmp_path):
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    from edge.telemetry import pending

    venv = edge_venv("3.8")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", MCAP_WRITE, str(tmp_path)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    actions, positions, observations, commands = [], [], [], []
    for f in pending(tmp_path / "telemetry" / "pending"):
        with open(f, "rb") as stream:
            for _, channel, _, msg in make_reader(stream, decoder_factories=[DecoderFactory()]).iter_decoded_messages():
                if channel.topic == "/sim2edge/actions":
                    actions += msg.data
                elif channel.topic == "/sim2edge/joint_states":
                    positions += msg.position
                elif channel.topic == "/sim2edge/observations":
                    observations += msg.data
                elif channel.topic == "/sim2edge/commands":
                    commands += msg.data
    assert actions == [0.0, 0.5, 1.0, 1.5, 2.0] and positions == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert observations == [0.0, 1.0, 2.0, 3.0, 4.0] and commands == [10.0, 11.0, 12.0, 13.0, 14.0]
