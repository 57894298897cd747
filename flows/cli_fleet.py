"""``sim2edge up``, ``serve``, ``deploy``, ``publish``, ``tuf rotate-root`` and ``devices``: the servers, the
deployments, the TUF repository and its keys, and the devices reporting."""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Optional

import typer

from flows.cli_output import console, fail, listing, print_json, print_listing
from flows.workspace import Workspace


def up(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    prefect_port: int = typer.Option(4200),
    mlflow_port: int = typer.Option(5000),
    database: Optional[str] = typer.Option(None, help="PostgreSQL for both servers: postgresql://USER[:PASSWORD]@HOST"
                                                      "[:PORT]/NAME (databases NAME_mlflow and NAME_prefect, created "
                                                      "if missing); default: SQLite files in the workspace."),
    auth: bool = typer.Option(False, help="Logins: MLflow's basic-auth app (nobody reads without one) and Prefect's "
                                          "API behind the admin login (SIM2EDGE_ADMIN_PASSWORD, or a password "
                                          "generated into the workspace)."),
    allowed_host: list[str] = typer.Option([], metavar="NAME[:PORT]",
                                           help="A further name MLflow answers to (a proxy's or a DNS alias; "
                                                "repeat for several). Off loopback it already answers to this "
                                                "machine's hostname, FQDN and addresses."),
    artifacts: Optional[str] = typer.Option(None, metavar="s3://BUCKET[/PREFIX]",
                                            help="MLflow's artifact store: an S3 bucket the server proxies (its "
                                                 "credentials and MLFLOW_S3_ENDPOINT_URL from the environment; "
                                                 "clients need none); default: the workspace's folder."),
    max_restarts: int = typer.Option(5, min=0, help="Restarts of a server that exits within 10 minutes before `up` "
                                                   "gives up and stops both."),
) -> None:
    """Start a Prefect server and an MLflow tracking server for this workspace, restarting one that exits;
    Ctrl-C stops both."""
    import signal

    from flows import services

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    from flows import team_artifacts, team_database

    ws = Workspace.from_env()
    try:
        db = team_database.parse(database) if database else None
        extra_hosts = tuple(services.check_allowed_host(name) for name in allowed_host)
        store = team_artifacts.parse(artifacts) if artifacts else None
    except (team_database.DatabaseError, ValueError) as e:
        fail(str(e))
    try:
        running = services.up(ws, host, prefect_port, mlflow_port, db, auth, extra_hosts, store)
    except (services.PortInUse, team_artifacts.ArtifactStoreError) as e:
        fail(str(e))
    except (services.ServiceError, team_database.DatabaseError) as e:
        fail(str(e), code=1)
    name = services.advertised_host(host)
    console.print(f"Prefect UI  http://{name}:{prefect_port}\nMLflow UI   http://{name}:{mlflow_port}\n"
                  f"workspace   {ws.home}\n{f'database    {db.shown}' + chr(10) if db else ''}"
                  f"{f'artifacts   {store.uri}' + chr(10) if store else ''}"
                  f"{logins(ws) if auth else ''}Ctrl-C stops both.", markup=False, highlight=False, soft_wrap=True)
    try:
        services.supervise(running, partial(console.print, markup=False, highlight=False, soft_wrap=True),
                           max_restarts)
    except KeyboardInterrupt:
        console.print("stopping")
    except services.ServiceError as e:
        fail(str(e), code=1)
    finally:
        services.stop(running)
        ws.services_file.unlink(missing_ok=True)


def logins(ws: Workspace) -> str:
    """The lines of ``up --auth`` saying where the admin's password is (never the password)."""
    from flows import team_auth

    where = (f"${team_auth.PASSWORD_ENV}" if os.environ.get(team_auth.PASSWORD_ENV)
             else str(team_auth.password_file(ws.home)))
    return f"logins      user {team_auth.ADMIN}, password in {where}\n"


def serve(
    timezone: str = typer.Option("UTC", help="Timezone of the nightly schedule (IANA name)."),
    cron: str = typer.Option("0 2 * * *", help="Nightly schedule."),
) -> None:
    """Serve the sim-to-edge, nightly-retrain, rollout and tune deployments from this process (one machine) on the
    Prefect server of `sim2edge up` (or PREFECT_API_URL); Ctrl-C stops."""
    ws = Workspace.from_env()
    ws.home.mkdir(parents=True, exist_ok=True)
    ws.configure_prefect()
    from flows.services import PrefectUnavailable, prefect_api

    try:
        prefect_api()  # before the flows' imports: a missing server is reported at once
        from flows.deployments import serve as serve_deployments

        serve_deployments(timezone, cron)
    except PrefectUnavailable as e:
        fail(str(e), code=1)


def deploy(
    pool: str = typer.Option("sim2edge-process", help="Process work pool (created if missing)."),
    timezone: str = typer.Option("UTC", help="Timezone of the nightly schedule (IANA name)."),
) -> None:
    """Register the deployments of prefect.yaml (sim-to-edge, rollout, tune, nightly-retrain) on a work pool of the Prefect server (PREFECT_API_URL)."""
    ws = Workspace.from_env()
    ws.configure_prefect()
    from flows.deployments import deploy as deploy_all

    done = deploy_all(pool, timezone)
    console.print(done.stdout[-3000:], markup=False, highlight=False)
    if done.returncode != 0:
        console.print(done.stderr[-3000:], markup=False, highlight=False)
        raise typer.Exit(done.returncode)
    console.print(f"Start a worker: prefect worker start --pool {pool}", markup=False)


def publish(
    ref: str = typer.Argument(..., help="<policy>@<alias> or <policy>@<version> of a registered policy."),
    repo: Path = typer.Option(..., help="TUF repository directory (static files to serve; made on first use)."),
    keys: Optional[Path] = typer.Option(None, help="TUF role keys (default: <workspace>/tuf-keys; never serve it)."),
    timestamp_s: float = typer.Option(86400.0, help="Lifetime of timestamp.json in seconds."),
    oci: Optional[str] = typer.Option(None, metavar="REGISTRY/NAME[:TAG]", help="Also push the repository as an OCI "
                                      "artifact (registry/tuf_oci.py; `oras pull` unpacks it)."),
    plain_http: bool = typer.Option(False, help="Talk to the --oci registry over plain HTTP (a registry on loopback)."),
) -> None:
    """Publish a registered version's bundle to a TUF repository (registry/tuf_repo.py) and tag the version
    with what was published where (sim2edge.tuf; sim2edge.oci with --oci)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from registry.models import registered_bundle
    from registry.tuf_repo import PublishConfig
    from registry.tuf_repo import publish as publish_tuf
    from registry.tuf_repo import tag_published

    ws = Workspace.from_env()
    policy, sep, which = ref.partition("@")
    if not sep or not policy or not which:
        fail(f"{ref!r} must look like <policy>@<alias> or <policy>@<version>")
    if oci is not None:
        from registry import tuf_oci

        try:
            tuf_oci.check_reference(oci)
        except ValueError as e:
            fail(str(e))
    client = MlflowClient(ws.tracking_uri())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            version, tar = registered_bundle(client, policy, which, Path(tmp))
            done = publish_tuf(PublishConfig(repo=repo, keys=keys or ws.home / "tuf-keys", bundle=tar, policy=policy,
                                             version=version, timestamp_s=timestamp_s))
        tag_published(client, policy, version, repo, done)
    except (MlflowException, OSError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    try:
        pushed = tuf_oci.push_repository(repo, oci, policy, version, plain_http) if oci is not None else None
        if pushed is not None:
            client.set_model_version_tag(policy, version, "sim2edge.oci", pushed.pinned)
    except (MlflowException, OSError, ValueError) as e:
        fail(f"published {policy} v{version} to {repo}, but not pushed: {str(e).splitlines()[0]}")
    console.print(f"published {policy} v{version} to {repo} as {done.target_path} (targets v{done.targets_version}, "
                  f"snapshot v{done.snapshot_version}, timestamp v{done.timestamp_version})"
                  f"{f'; pushed {pushed.pinned}' if pushed else ''}", soft_wrap=True, markup=False, highlight=False)


tuf_app = typer.Typer(no_args_is_help=True, help="Manage the keys of a TUF repository written by `sim2edge publish`.")


@tuf_app.command("rotate-root")
def rotate_root(
    repo: Path = typer.Option(..., help="TUF repository directory written by `sim2edge publish`."),
    new_keys: Path = typer.Option(..., help="Directory of the keys that replace the current ones (made if missing; "
                                            "copy a role's old key file there to keep that key)."),
    keys: Optional[Path] = typer.Option(None, help="The current role keys (default: <workspace>/tuf-keys)."),
    timestamp_s: float = typer.Option(86400.0, help="Lifetime of the re-signed timestamp.json in seconds."),
) -> None:
    """Rotate the repository's root key (registry/tuf_rotation.py): root v N+1 names the new keys and is signed by
    the old root key and the new one; targets, snapshot and timestamp are re-signed with the new keys."""
    from registry.tuf_rotation import RotateConfig
    from registry.tuf_rotation import rotate_root as rotate

    old = keys or Workspace.from_env().home / "tuf-keys"
    try:
        done = rotate(RotateConfig(repo=repo, keys=old, new_keys=new_keys, timestamp_s=timestamp_s))
    except (OSError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    console.print(f"rotated {repo} to root v{done.root_version} (new keys for {', '.join(done.rotated)} from "
                  f"{new_keys}; timestamp v{done.timestamp_version}): publish with --keys {new_keys}, retire {old}",
                  soft_wrap=True, markup=False, highlight=False)


def devices(model: Optional[str] = typer.Option(None, help="Registered model (default: every one)."),
            as_json: bool = typer.Option(False, "--json", help="Print the reports as JSON."),
            mqtt: Optional[str] = typer.Option(None, help="Read the fleet's retained state reports from this MQTT "
                                               "broker instead (mqtt://HOST:PORT or mqtts://; edge/mqtt_report.py)."),
            fleet: str = typer.Option("default", help="With --mqtt: the fleet (topics sim2edge/<fleet>/+/state)."),
            rings: Optional[Path] = typer.Option(None, help="With --mqtt: a ring spec (YAML, registry/rings.py) "
                                                 "to show each device's ring."),
            mqtt_user: str = typer.Option("sim2edge-reader", help="With --mqtt: the broker user."),
            mqtt_password_file: Optional[Path] = typer.Option(
                None, help="With --mqtt: its password (default: $SIM2EDGE_MQTT_PASSWORD).")) -> None:
    """List the devices reporting to the registry (sim2edge-agent watch and run): version, health, runtime,
    control-loop timing, last error; with --mqtt, those reporting to the broker, with their labels and ring."""
    if mqtt:
        return _mqtt_devices(mqtt, fleet, rings, mqtt_user, mqtt_password_file, as_json)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from registry.devices import devices as reports

    try:
        states = reports(MlflowClient(Workspace.from_env().tracking_uri()), model)
    except (MlflowException, ValueError) as e:
        fail(str(e))
    if as_json:
        print_json([d.model_dump() for d in states])
        return
    if not states:
        console.print("no device has reported")
        return
    rows = []
    for d in states:
        e, c = d.last_error or {}, d.control
        loop = (f"act p99 {c.get('act_p99_us')} us, {c.get('deadline_misses', 0)} late, "
                f"{c.get('safe_default', 0)} unsafe, {c.get('watchdog_trips', 0)} watchdog / {c.get('ticks', 0)} ticks"
                if c else "-")
        rows.append([d.model, d.device, d.version or "-", d.health or "-", d.runtime or "-", loop, f"{d.age_s:.0f} s ago",
                     f"{e.get('check') or e.get('event')}: {e.get('detail', '')}"[:100] if e else ""])
    print_listing(listing(["model", "device", "version", "health", "runtime", "control loop", "reported", "last error"],
                          rows, ids=2))


def _mqtt_devices(url: str, fleet: str, rings: Optional[Path], user: str, password_file: Optional[Path],
                  as_json: bool) -> None:
    """``devices --mqtt``: registry/fleet_state.py's reading of the broker, each device with its ring."""
    import os

    from pydantic import ValidationError

    from edge.mqtt_report import read_password
    from registry.fleet_state import read_fleet
    from registry.rings import RingSpec, ring_of

    try:
        spec = RingSpec.load(rings) if rings else None
        state = read_fleet(url, fleet, user, read_password(password_file, dict(os.environ)))
    except ValidationError as e:
        fail(f"ring spec {rings}: {e.errors()[0]['msg']} at {'.'.join(map(str, e.errors()[0]['loc']))}")
    except (OSError, ValueError) as e:
        fail(str(e))
    ring = {d.device: ring_of(d.device, d.labels, spec) if spec else None for d in state.devices}
    if as_json:
        print_json({"devices": [dict(d.model_dump(), ring=ring[d.device]) for d in state.devices],
                    "malformed": [m.model_dump() for m in state.malformed]})
        return
    now = time.time()
    rows = [[d.device, ring[d.device] or "-", d.policy or "-", d.version or "-", d.health, d.runtime or "-",
             ",".join(f"{k}={v}" for k, v in sorted(d.labels.items())) or "-", f"{now - d.time:.0f} s ago"]
            for d in state.devices]
    if rows:
        print_listing(listing(["device", "ring", "policy", "version", "health", "runtime", "labels", "reported"],
                              rows))
    else:
        console.print(f"no device of fleet {fleet!r} has reported")
    for m in state.malformed:
        console.print(f"malformed: {m.topic}: {m.reason}", soft_wrap=True)
