"""``sim2edge up``: a Prefect server and an MLflow tracking server on loopback, for one workspace; and the
check that a Prefect server answers, which ``sim2edge serve`` needs.

Bound to another address (``--host 0.0.0.0``), MLflow's DNS-rebinding protection would refuse every request by a
name it does not know (403 for ``http://<machine>:5000``): the server is told the names this machine answers to
(:func:`allowed_hosts`), and Prefect's UI is told to call its API by the machine's name, never ``0.0.0.0``."""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from flows import team_artifacts, team_auth, team_database
from flows.team_artifacts import S3Store
from flows.team_database import TeamDatabase
from flows.workspace import Workspace, healthy


@dataclass
class Service:
    """A server process of ``sim2edge up``, with the command and environment that start it again."""
    name: str
    url: str
    health: str
    process: subprocess.Popen
    log: Path
    cmd: list[str]
    env: dict[str, str]


class ServiceError(RuntimeError):
    """A server of ``sim2edge up`` could not start; the message says which, why and where to look."""


class PortInUse(ServiceError):
    """A port ``sim2edge up`` needs is taken; nothing was started."""


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (as the servers bind: with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_owner(port: int) -> str | None:
    """``pid COMMAND`` of the process listening on TCP ``port``, best-effort from /proc (Linux); None if unknown."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                argv = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
                command = " ".join([Path(argv[0].decode()).name, *(a.decode() for a in argv[1:])])
                return f"pid {proc.name} {command[:60]}"
        except OSError:
            continue
    return None


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Refuse, naming the option to change, a port that is taken or given twice (``ports``: option → port)."""
    if len(set(ports.values())) < len(ports):
        raise PortInUse(f"{' and '.join(ports)} are the same port ({next(iter(ports.values()))}); give each its own")
    for option, port in ports.items():
        if not port_free(host, port):
            owner = port_owner(port)
            raise PortInUse(f"port {port} on {host} is in use{f' ({owner})' if owner else ''}; pass {option}")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
HOST_NAME = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9*]([A-Za-z0-9.*-]*[A-Za-z0-9*])?)(:[0-9]{1,5})?")
"""What ``--allowed-host`` takes: a DNS name or address, ``*`` wildcards inside it, an optional ``:port``."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_allowed_host(name: str) -> str:
    """``name`` if MLflow can match it against a Host header; ValueError naming it otherwise."""
    if name.strip("*.:") == "" or not HOST_NAME.fullmatch(name):
        raise ValueError(f"--allowed-host {name!r}: expected a host name or address, optionally with :PORT "
                         "(e.g. robots.lab.example or mlflow.lab.example:443)")
    return name


def interface_addresses() -> set[str]:
    """This machine's IPv4 addresses (one per interface) and global IPv6 addresses; Linux, empty where unreadable."""
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's address, in a struct ifreq
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found.add(socket.inet_ntoa(packed[20:24]))
    try:
        rows = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        rows = []
    found |= {str(ipaddress.IPv6Address(int(f[0], 16))) for f in map(str.split, rows) if f[3] == "00"}  # 00: global
    return found


def machine_fqdn() -> str:
    """This machine's fully qualified name; its hostname where that resolves to localhost only (Debian's 127.0.1.1)."""
    name = socket.getfqdn()
    return socket.gethostname() if name == "localhost" or name.startswith("localhost.") else name


def machine_names() -> list[str]:
    """The hostname, FQDN and addresses that name this machine in a request's Host header (IPv6 in brackets)."""
    names = [socket.gethostname(), machine_fqdn()]
    addresses = set(interface_addresses())
    for name in set(names):
        try:
            addresses |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            continue
    return list(dict.fromkeys([*names, *(f"[{a}]" if ":" in a else a for a in sorted(addresses))]))


def advertised_host(host: str) -> str:
    """The name to give others for a server bound to ``host``: the machine's FQDN for a wildcard bind."""
    try:
        return machine_fqdn() if ipaddress.ip_address(host).is_unspecified else host
    except ValueError:
        return host


def allowed_hosts(host: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The Host headers MLflow should accept when bound to ``host``: none to pass (its default: loopback and private
    addresses) on loopback without ``extra``; else loopback, ``host``, this machine's names (off loopback) and
    ``extra``, each with any port."""
    if is_loopback(host) and not extra:
        return []
    bound = f"[{host}]" if ":" in host else host
    names = [*LOOPBACK_NAMES, bound, *([] if is_loopback(host) else machine_names()), *extra]
    patterns = []
    for name in dict.fromkeys(names):
        patterns.append(name)
        if name.endswith("]") or not re.search(r":[0-9]+$", name):  # no port of its own: any port
            patterns.append(f"{name.replace('[', '[[]', 1)}:*")  # fnmatch: a literal '[' of an IPv6 address
    return patterns


def allowed_origins(host: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """Origins whose pages (MLflow's own UI, reached by a machine name or ``extra``: a proxy's) may change things:
    MLflow refuses a state-changing API call from any origin but localhost's otherwise."""
    if is_loopback(host) and not extra:
        return []
    names = [] if is_loopback(host) else [n for n in machine_names() if n not in LOOPBACK_NAMES]
    return [*(f"http://{n}:{port}" for n in names), *(f"{scheme}://{n}" for n in extra for scheme in ("http", "https"))]


def log_tail(log: Path, lines: int = 8) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def mlflow_command(ws: Workspace, host: str, port: int, backend: str | None = None, auth: bool = False,
                   hosts: list[str] | None = None, origins: list[str] | None = None,
                   artifacts: str | None = None) -> list[str]:
    """MLflow's server on ``backend`` (default: the workspace's SQLite file), artifacts behind its proxy (in
    ``artifacts``, e.g. ``s3://bucket/prefix``, or the workspace's folder); with
    ``auth`` its basic-auth app (configured through the environment: :func:`flows.team_auth.prepare`); ``hosts``
    and ``origins``: the Host headers and origins it accepts besides its defaults' (:func:`allowed_hosts`)."""
    ws.mlflow_artifacts.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "mlflow", "server", *(["--app-name", "basic-auth"] if auth else []),
            "--backend-store-uri", backend or f"sqlite:///{ws.mlflow_db}",
            "--artifacts-destination", artifacts or str(ws.mlflow_artifacts), "--serve-artifacts",
            "--host", host, "--port", str(port), "--workers", "1",
            *(["--allowed-hosts", ",".join(hosts)] if hosts else []),
            *(["--cors-allowed-origins", ",".join(origins)] if origins else [])]


def prefect_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]


def start(ws: Workspace, name: str, cmd: list[str], url: str, health: str, log: Path,
          extra_env: dict[str, str] | None = None) -> Service:
    # the UI's browser code calls the API at PREFECT_UI_API_URL (default: port 4200)
    env = {**os.environ, "PREFECT_HOME": str(ws.prefect_home), "PREFECT_UI_API_URL": f"{url}/api", **(extra_env or {})}
    env.pop("PREFECT_API_URL", None)
    return Service(name, url, health, spawn(cmd, env, log), log, cmd, env)


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``cmd`` in a session (and process group) of its own, its output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_group(s: Service, sig: int = signal.SIGKILL) -> None:
    """Signal ``s``'s process group: the server and what it started (MLflow's uvicorn, Prefect's), if any is left."""
    try:
        os.killpg(s.process.pid, sig)
    except ProcessLookupError:
        pass


def restart(s: Service, why: str) -> None:
    """Start ``s`` again with its command and environment, first killing what is left of its group (a worker of a
    killed server still holds its port), with ``why`` appended to its log."""
    kill_group(s)
    with open(s.log, "a") as out:
        out.write(f"sim2edge up: {why}\n")
    s.process = spawn(s.cmd, s.env, s.log)


def supervise(services: list[Service], report: Callable[[str], None], max_restarts: int = 5,
              window_s: float = 600, poll_s: float = 1.0) -> NoReturn:
    """Restart a server that exits, ``report``ing each restart in one line, until one exits again after
    ``max_restarts`` restarts within ``window_s``: then :class:`ServiceError` names it with its log's end (the
    caller stops the servers)."""
    restarts: dict[str, list[float]] = {s.name: [] for s in services}
    window = f"{window_s / 60:g} min"
    while True:
        time.sleep(poll_s)
        for s in services:
            code = s.process.poll()
            if code is None:
                continue
            now = time.monotonic()
            recent = restarts[s.name] = [t for t in restarts[s.name] if now - t < window_s]
            n = len(recent)
            if n >= max_restarts:
                kill_group(s)
                raise ServiceError(f"{s.name} exited with code {code} after {n} restart{'s' * (n != 1)} in the last "
                                   f"{window}; giving up; the end of its log {s.log}:\n{log_tail(s.log)}")
            recent.append(now)
            line = f"{s.name} exited with code {code}; restarted ({n + 1} of {max_restarts} in the last {window})"
            restart(s, line)
            report(line)


def wait_healthy(services: list[Service], timeout_s: float = 120) -> None:
    """Until every server answers its health check. One that exits during start-up is started once more (Prefect's
    server once exited at start-up on a loaded machine, in a test run, and started when tried again alone); a
    second exit is a :class:`ServiceError` with its code and log."""
    deadline = time.monotonic() + timeout_s
    pending, retried = list(services), set()
    while pending and time.monotonic() < deadline:
        for s in list(pending):
            code = s.process.poll()
            if code is not None and s.name in retried:
                raise ServiceError(f"{s.name} exited with code {code} during start-up, twice; "
                                   f"the end of its log {s.log}:\n{log_tail(s.log)}")
            if code is not None:
                retried.add(s.name)
                restart(s, f"{s.name} exited with code {code} during start-up; starting it once more")
            if healthy(s.url, s.health):
                pending.remove(s)
        time.sleep(0.5)
    if pending:
        raise ServiceError(f"{', '.join(s.name for s in pending)} not healthy after {timeout_s:.0f} s; "
                           f"see {', '.join(str(s.log) for s in pending)}")


def stop(services: list[Service], grace_s: float = 8.0) -> None:
    """SIGTERM each process group (SIGKILL what is left of one whose server exited), then SIGKILL what is still
    alive after the grace period."""
    for s in services:
        kill_group(s, signal.SIGTERM if s.process.poll() is None else signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    for s in services:
        try:
            s.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(s)
            s.process.wait()


def up(ws: Workspace, host: str, prefect_port: int, mlflow_port: int,
       database: TeamDatabase | None = None, auth: bool = False, extra_hosts: tuple[str, ...] = (),
       artifacts: S3Store | None = None) -> list[Service]:
    """Start both servers (on SQLite files in the workspace, or on ``database``: PostgreSQL, checked and prepared
    first; with ``auth`` behind logins, :mod:`flows.team_auth`; MLflow answering this machine's names off loopback,
    and ``extra_hosts``; its artifacts in the workspace or in ``artifacts``, an S3 bucket checked first), wait until
    healthy, and record their URLs in the workspace; a taken port is refused (:class:`PortInUse`) before anything
    starts, a server that stops during start-up stops the other."""
    check_ports(host, {"--mlflow-port": mlflow_port, "--prefect-port": prefect_port})
    if artifacts is not None:
        team_artifacts.check(artifacts)
    if database is not None:
        team_database.prepare(database, auth)
    logs = ws.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ws.prefect_home.mkdir(parents=True, exist_ok=True)
    mlflow_env: dict[str, str] = {}
    prefect_env = {"PREFECT_UI_API_URL": f"http://{advertised_host(host)}:{prefect_port}/api",
                   **({"PREFECT_API_DATABASE_CONNECTION_URL": database.prefect_url} if database else {})}
    if auth:
        mlflow_auth, prefect_auth = team_auth.prepare(
            ws.home, database.auth_url if database else f"sqlite:///{ws.mlflow_db.parent / 'auth.db'}")
        mlflow_env.update(mlflow_auth)
        prefect_env.update(prefect_auth)
    mlflow_url, prefect_url = f"http://{host}:{mlflow_port}", f"http://{host}:{prefect_port}"
    services = [
        start(ws, "mlflow", mlflow_command(ws, host, mlflow_port, database and database.mlflow_url, auth,
                                           allowed_hosts(host, extra_hosts),
                                           allowed_origins(host, mlflow_port, extra_hosts),
                                           artifacts and artifacts.uri),
              mlflow_url, "/health", logs / "mlflow.log", mlflow_env),
        start(ws, "prefect", prefect_command(host, prefect_port), prefect_url, "/api/health", logs / "prefect.log",
              prefect_env),
    ]
    try:
        wait_healthy(services)
    except BaseException:
        stop(services)
        raise
    ws.services_file.write_text(json.dumps({"mlflow": mlflow_url, "prefect": prefect_url, "auth": auth}))
    return services


class PrefectUnavailable(RuntimeError):
    """No Prefect server answers; the message says which and what to do."""


def prefect_api() -> str:
    """The configured Prefect API URL (``PREFECT_API_URL``, set by :meth:`Workspace.configure_prefect` while
    ``sim2edge up`` runs), if a server answers there. ``sim2edge serve`` needs one that outlives it: Prefect's
    temporary server would stop with the serving process, and with the same Ctrl-C, before the schedules
    are paused on it."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        raise PrefectUnavailable("no Prefect server to serve on: start `sim2edge up` in this workspace "
                                 "or set PREFECT_API_URL")
    if not healthy(api, "/health"):
        raise PrefectUnavailable(f"the Prefect server at {api} does not answer: start `sim2edge up` "
                                 "or check PREFECT_API_URL")
    return api
