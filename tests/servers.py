"""Servers the tests run as their own processes on loopback: nginx for static files (a TUF repository) and
mosquitto with a password file and ACL (device state reports)."""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def wait_listening(proc: subprocess.Popen, port: int, log: Path | None = None) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (
                log.read_text() if log and log.exists() else proc.stderr.read().decode())
            time.sleep(0.05)


def wait_up(up: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    """Until ``sim2edge up`` (``up``, its output in ``log``) says both servers answer; fails with the log's tail if it
    exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while "Ctrl-C stops both" not in log.read_text():
        assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def start_nginx(d: Path, port: int) -> subprocess.Popen:
    """nginx serving ``<d>/www`` on 127.0.0.1:``port``; returns once it listens (stop with :func:`stop_nginx`)."""
    (d / "www").mkdir(parents=True, exist_ok=True)
    temp = "\n".join(f"  {kind}_temp_path {d}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (d / "nginx.conf").write_text(f"""daemon off;
user {getpass.getuser()};
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 256; }}
http {{
  access_log {d}/access.log;
{temp}
  default_type application/octet-stream;
  server {{ listen 127.0.0.1:{port}; root {d}/www; }}
}}
""")
    proc = subprocess.Popen(["nginx", "-e", str(d / "error.log"), "-c", str(d / "nginx.conf"), "-p", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_listening(proc, port, d / "error.log")
    return proc


def stop_nginx(d: Path, proc: subprocess.Popen) -> None:
    os.kill(int((d / "nginx.pid").read_text()), signal.SIGTERM)  # fast shutdown
    proc.wait(timeout=10)


def start_mosquitto(d: Path, port: int, users: dict[str, str]) -> subprocess.Popen:
    """mosquitto on 127.0.0.1:``port`` with a password file of ``users`` and an ACL: ``sim2edge-reader`` reads
    every report, ``admin`` reads and writes them, every other user writes its own state topic only."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "passwd").write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
    subprocess.run(["mosquitto_passwd", "-U", str(d / "passwd")], check=True)
    (d / "acl").write_text("user sim2edge-reader\ntopic read sim2edge/#\n\nuser admin\ntopic readwrite sim2edge/#\n\n"
                           "pattern readwrite sim2edge/+/%u/state\n")
    (d / "mosquitto.conf").write_text(f"user {getpass.getuser()}\nper_listener_settings false\n"
                                      f"listener {port} 127.0.0.1\nallow_anonymous false\n"
                                      f"password_file {d}/passwd\nacl_file {d}/acl\npersistence false\n"
                                      f"log_dest file {d}/mosquitto.log\n")
    proc = subprocess.Popen(["mosquitto", "-c", str(d / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    wait_listening(proc, port)
    return proc
