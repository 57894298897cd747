"""Registered models: one per policy; each candidate a version; aliases say where it stands.

The bundle tags written here are the device contract that ``edge.registry_client`` reads.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from edge.registry_answers import TAG_PATH, TAG_SHA256, TAG_SIZE

CHAMPION, CHALLENGER = "champion", "challenger"
BARRIER_ENV = "SIM2EDGE_PROMOTE_BARRIER"
TAG_RESERVATION = "sim2edge.reservation"


def proxy_path(artifact_uri: str, artifact_root: Path | None) -> str:
    """The path under the tracking server's artifact proxy for a run artifact URI."""
    if artifact_uri.startswith("mlflow-artifacts:"):
        return artifact_uri.split(":", 1)[1].lstrip("/")
    if artifact_root is not None:
        root = artifact_root.resolve().as_uri().rstrip("/") + "/"
        if artifact_uri.startswith(root):
            return artifact_uri[len(root):]
    raise ValueError(f"artifact URI {artifact_uri!r} is not served by the artifact proxy (root {artifact_root})")


def reserve_version(client: MlflowClient, name: str, run_id: str, source: str, tags: dict,
                    model_id: str | None = None) -> str:
    """Create a new version of ``name`` (creating the model on first use); return its number.

    ``source`` is ``models:/<model_id>`` for a policy logged as an MLflow Model (:mod:`registry.policy_model`).
    The MLflow client retries a request whose answer was lost (a server killed after committing), and a create is
    not idempotent: each reservation carries its own token (``sim2edge.reservation``), and any other version with
    this one's token is such a duplicate and is deleted, so no orphan is left (tests/test_team_restart.py)."""
    try:
        client.create_registered_model(name, description=f"sim2edge policies for task {name}")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    token = uuid.uuid4().hex
    version = str(client.create_model_version(name, source=source, run_id=run_id, tags={**tags, TAG_RESERVATION: token},
                                              model_id=model_id).version)
    for other in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if str(other.version) != version and other.tags.get(TAG_RESERVATION) == token:
            client.delete_model_version(name, str(other.version))
    return version


def current_champion(client: MlflowClient, name: str) -> str | None:
    try:
        return str(client.get_model_version_by_alias(name, CHAMPION).version)  # an int from SQL stores
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def publish(client: MlflowClient, name: str, version: str, bundle_path: str, sha256: str, size: int,
            passed: bool, tags: dict, expected_champion: str | None) -> str:
    """Tag the version with its bundle, then move the alias last; return the alias.

    ``champion`` moves only if the gate passed *and* the champion is still ``expected_champion``
    (the one this run was compared against), and stays only if it reads back as this version.
    Reading and moving are two calls: callers serialize them per policy (``flows.promotion.promote_slot``),
    so of two overlapping runs only one can promote; the loser is a challenger tagged with why.
    """
    for k, v in {**tags, TAG_PATH: bundle_path, TAG_SHA256: sha256, TAG_SIZE: str(size),
                 "sim2edge.gate": "pass" if passed else "fail"}.items():
        client.set_model_version_tag(name, version, k, str(v))
    if passed:
        now = current_champion(client, name)
        _barrier()
        if now != expected_champion:
            why = f"the champion changed during this run (v{expected_champion} → v{now})"
        else:
            client.set_registered_model_alias(name, CHAMPION, version)
            if (now := current_champion(client, name)) == version:
                return CHAMPION
            why = f"v{now} was promoted at the same time"
        client.set_model_version_tag(name, version, "sim2edge.not_promoted", why)
    client.set_registered_model_alias(name, CHALLENGER, version)
    return CHALLENGER


def registered_bundle(client: MlflowClient, name: str, alias_or_version: str, dst: Path) -> tuple[str, Path]:
    """Download the bundle of ``name``'s version (a number or an alias) into ``dst``, checked against its tags;
    returns (version, path)."""
    from edge.bundle import sha256_path

    if alias_or_version.isdigit():
        mv = client.get_model_version(name, alias_or_version)
    else:
        mv = client.get_model_version_by_alias(name, alias_or_version)
    tags = mv.tags or {}
    if TAG_PATH not in tags or TAG_SHA256 not in tags:
        raise ValueError(f"{name} v{mv.version} has no bundle (tags {TAG_PATH}, {TAG_SHA256})")
    _, sep, artifact = tags[TAG_PATH].partition("/artifacts/")
    if not sep or not mv.run_id:
        raise ValueError(f"{name} v{mv.version}: bundle path {tags[TAG_PATH]!r} is not a run artifact")
    path = Path(client.download_artifacts(mv.run_id, artifact, str(dst)))
    if sha256_path(path) != tags[TAG_SHA256]:
        raise ValueError(f"{name} v{mv.version}: downloaded bundle does not match its tag {TAG_SHA256}")
    return str(mv.version), path


def _barrier() -> None:
    """Test hook between reading the champion and moving it: ``SIM2EDGE_PROMOTE_BARRIER=<dir>:<n>:<seconds>``
    marks this process in ``<dir>`` and waits until ``n`` have arrived or ``seconds`` passed (unset in normal use)."""
    if not (spec := os.environ.get(BARRIER_ENV)):
        return
    folder, n, seconds = spec.rsplit(":", 2)
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + float(seconds)
    while len(os.listdir(folder)) < int(n) and time.monotonic() < deadline:
        time.sleep(0.05)
