"""Logins on ``sim2edge up --auth``: MLflow's basic-auth app, and Prefect's API behind the same admin login.

Files, all in the workspace and readable by their owner only (0600):

- ``auth/auth.ini``: MLflow's auth config (``MLFLOW_AUTH_CONFIG_PATH``): ``default_permission = NO_PERMISSIONS``
  (nobody reads without a grant; admins read and write everything), ``admin_username = admin`` and the auth
  database (``mlflow/auth.db`` beside the tracking store, or ``NAME_auth`` under ``--database``). It holds no
  password: the server gets the admin's from ``MLFLOW_AUTH_ADMIN_PASSWORD`` in its environment.
- ``auth/admin-password``: the admin's password when ``SIM2EDGE_ADMIN_PASSWORD`` is not set, generated on the
  first ``up --auth`` and reused after. MLflow sets the admin's password only when it creates the auth database;
  later changes go through its update-password API.

Prefect 3 (``PREFECT_SERVER_API_AUTH_STRING``) then asks every API request but ``/api/health`` and ``/api/ready``
for HTTP basic auth ``admin:PASSWORD``; clients in the workspace send it (``PREFECT_API_AUTH_STRING``, set by
:meth:`flows.workspace.Workspace.configure_prefect`).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

ADMIN = "admin"
PASSWORD_ENV = "SIM2EDGE_ADMIN_PASSWORD"


@dataclass(frozen=True)
class Login:
    """A user name and password; ``repr`` hides the password."""

    username: str
    password: str

    def __repr__(self) -> str:
        return f"Login({self.username!r}, ***)"


def config_file(home: Path) -> Path:
    return home / "auth" / "auth.ini"


def password_file(home: Path) -> Path:
    return home / "auth" / "admin-password"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, created 0600 (never readable by others, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def admin_login(home: Path, create: bool = False) -> Login | None:
    """The admin's login: ``SIM2EDGE_ADMIN_PASSWORD``, else the workspace's password file (generated when
    ``create``); None when neither exists."""
    if os.environ.get(PASSWORD_ENV):
        return Login(ADMIN, os.environ[PASSWORD_ENV])
    path = password_file(home)
    if not path.exists():
        if not create:
            return None
        write_private(path, secrets.token_urlsafe(24) + "\n")
    return Login(ADMIN, path.read_text().strip())


def prepare(home: Path, database_uri: str) -> tuple[dict[str, str], dict[str, str]]:
    """Write the auth config; return the extra environment of MLflow's server and of Prefect's."""
    admin = admin_login(home, create=True)
    write_private(config_file(home), f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = {database_uri}\n"
                                     f"admin_username = {ADMIN}\n"
                                     "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                                     # PBKDF2 once per (user, password) a minute, not on every request
                                     "auth_cache_ttl_seconds = 60\n")
    mlflow_env = {"MLFLOW_AUTH_CONFIG_PATH": str(config_file(home)), "MLFLOW_AUTH_ADMIN_PASSWORD": admin.password,
                  "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
    prefect_env = {"PREFECT_SERVER_API_AUTH_STRING": f"{admin.username}:{admin.password}"}
    return mlflow_env, prefect_env
