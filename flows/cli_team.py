"""``sim2edge users``: logins on the MLflow server of ``sim2edge up --auth``, made with its admin login."""

from __future__ import annotations

import os
import secrets
import sys
import warnings

import typer

from flows.cli_output import console, fail
from flows.workspace import Workspace, healthy

users_app = typer.Typer(no_args_is_help=True, help="Logins on the MLflow server of `sim2edge up --auth`.")


def admin_server(ws: Workspace) -> str:
    """The server's URL (``MLFLOW_TRACKING_URI`` or this workspace's ``up``), the admin's login put in the
    environment for MLflow's clients; one-line errors for a missing server or login."""
    from flows import team_auth

    url = os.environ.get("MLFLOW_TRACKING_URI") or ws.services().get("mlflow")
    if not url or not url.startswith("http"):
        fail("no MLflow server: start `sim2edge up --auth` in this workspace or set MLFLOW_TRACKING_URI", code=1)
    if not healthy(url, "/health"):
        fail(f"the MLflow server at {url} does not answer", code=1)
    admin = team_auth.admin_login(ws.home)
    if admin is None:
        fail(f"no admin password: set {team_auth.PASSWORD_ENV}", code=1)
    os.environ.update(MLFLOW_TRACKING_USERNAME=admin.username, MLFLOW_TRACKING_PASSWORD=admin.password)
    return url


def policy_experiments(registry, policy: str) -> set[str]:
    """Ids of the experiments holding the runs of ``policy``'s versions (``sim2edge/<policy>`` in the pipeline)."""
    runs = {v.run_id for v in registry.search_model_versions(f"name = '{policy}'") if v.run_id}
    return {registry.get_run(r).info.experiment_id for r in runs}


@users_app.command("add-device")
def add_device(
    name: str = typer.Argument(..., help="The device's user name (e.g. its robot id)."),
    policy: list[str] = typer.Option(..., help="Registered model the device may read (repeat for several)."),
    password_stdin: bool = typer.Option(False, help="Read the password from stdin instead of generating one."),
) -> None:
    """Create a device's login: READ on the named policies (and the experiments of their versions' runs, where the
    bundles are), nothing else; prints the password once."""
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():  # its server module's Starlette import warns; this is a client
        warnings.simplefilter("ignore")
        from mlflow.server.auth.client import AuthServiceClient

    url = admin_server(Workspace.from_env())
    password = sys.stdin.readline().strip() if password_stdin else secrets.token_urlsafe(18)
    if not password:
        fail("--password-stdin: empty password")
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")  # a refusal is final: say so at once
    registry, auth = MlflowClient(url), AuthServiceClient(url)
    try:
        experiments = set()
        for p in policy:
            try:
                registry.get_registered_model(p)
            except RestException as e:
                if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                    fail(f"--policy {p}: no such registered model at {url}", code=1)
                raise
            experiments |= policy_experiments(registry, p)
        auth.create_user(name, password)
        for p in policy:
            auth.grant_user_permission(name, "registered_model", p, "READ")
        for experiment in sorted(experiments):  # the bundles are run artifacts, read under the experiment's grant
            auth.grant_user_permission(name, "experiment", experiment, "READ")
    except MlflowException as e:
        status = e.get_http_status_code()
        if status == 401:
            fail(f"the MLflow server at {url} refused the admin login (HTTP 401): check SIM2EDGE_ADMIN_PASSWORD",
                 code=1)
        fail(f"{name}: {' '.join(str(e.message).split())[:200]}", code=1)
    console.print(f"device user {name}: READ on {', '.join(policy)}", markup=False, highlight=False, soft_wrap=True)
    if not password_stdin:
        console.print(f"password (shown once): {password}", markup=False, highlight=False, soft_wrap=True)
