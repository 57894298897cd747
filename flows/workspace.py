"""The embedded-defaults workspace: everything under one folder (``SIM2EDGE_HOME``, default ``./.sim2edge``)."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from flows import team_auth


def healthy(url: str, path: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Workspace(BaseModel):
    model_config = ConfigDict(frozen=True)
    home: Path

    @classmethod
    def from_env(cls) -> "Workspace":
        return cls(home=Path(os.environ.get("SIM2EDGE_HOME", ".sim2edge")).resolve())

    @property
    def prefect_home(self) -> Path:
        return self.home / "prefect"

    @property
    def mlflow_db(self) -> Path:
        return self.home / "mlflow" / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.home / "mlflow" / "artifacts"

    @property
    def keys_dir(self) -> Path:
        return self.home / "keys"

    @property
    def device_root(self) -> Path:
        return self.home / "device"

    @property
    def datasets(self) -> Path:
        return self.home / "datasets"

    @property
    def standin_uploads(self) -> Path:
        """Where the reference-robot stand-in drops its logs, as a device's upload folder would."""
        return self.home / "standin-uploads"

    @property
    def runs(self) -> Path:
        return self.home / "runs"

    @property
    def services_file(self) -> Path:
        return self.home / "services.json"

    def services(self) -> dict:
        """URLs of the servers ``sim2edge up`` runs for this workspace, if they answer."""
        if not self.services_file.exists():
            return {}
        urls = json.loads(self.services_file.read_text())
        ok = {"mlflow": "/health", "prefect": "/health"}
        return {k: v for k, v in urls.items() if k in ok and healthy(v if k == "mlflow" else v + "/api", ok[k])}

    def admin_login(self) -> team_auth.Login | None:
        """The admin's login of the running ``sim2edge up --auth`` (:mod:`flows.team_auth`); None without one."""
        if not self.services_file.exists() or not json.loads(self.services_file.read_text()).get("auth"):
            return None
        return team_auth.admin_login(self.home)

    def tracking_uri(self) -> str:
        """``MLFLOW_TRACKING_URI``, else the running ``sim2edge up`` server (with its admin login unless
        ``MLFLOW_TRACKING_USERNAME`` names another), else the SQLite file."""
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        up = self.services().get("mlflow")
        if up:
            admin = self.admin_login()
            if admin and not os.environ.get("MLFLOW_TRACKING_USERNAME"):
                os.environ.update(MLFLOW_TRACKING_USERNAME=admin.username, MLFLOW_TRACKING_PASSWORD=admin.password)
            return up
        self.mlflow_db.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.mlflow_db}"

    def artifact_root(self) -> Path | None:
        """The folder the embedded store and ``sim2edge up``'s server keep artifacts in; None when
        ``MLFLOW_TRACKING_URI`` names another store. Experiments created through a tracking server use its
        artifact proxy (``mlflow-artifacts:``) instead: ``registry.tracking.ensure_experiment``."""
        return None if os.environ.get("MLFLOW_TRACKING_URI") else self.mlflow_artifacts

    def configure_prefect(self) -> None:
        """Point Prefect at this workspace (call before importing prefect)."""
        os.environ.setdefault("PREFECT_HOME", str(self.prefect_home))
        # persisted task results (the stage cache) live in the workspace
        os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(self.prefect_home / "storage"))
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # the temporary local API takes ~18 s to start on 2 loaded cores; Prefect's default limit is 20 s
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        up = self.services().get("prefect")
        if up and not os.environ.get("PREFECT_API_URL"):
            os.environ["PREFECT_API_URL"] = up + "/api"
            admin = self.admin_login()
            if admin:  # Prefect's API behind `up --auth` asks for the admin's login
                os.environ.setdefault("PREFECT_API_AUTH_STRING", f"{admin.username}:{admin.password}")
