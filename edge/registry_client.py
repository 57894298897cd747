"""The MLflow REST contract the device uses, with the standard library only.

1. ``GET /api/2.0/mlflow/registered-models/alias?name=<policy>&alias=<alias>`` or
   ``GET /api/2.0/mlflow/model-versions/get?name=<policy>&version=<n>`` → ``model_version``.
2. The version's tags name the bundle: ``sim2edge.bundle.path`` (path under the artifact
   proxy root), ``sim2edge.bundle.sha256`` and ``sim2edge.bundle.size``.
3. ``GET /api/2.0/mlflow-artifacts/artifacts/<path>`` streams the bundle (artifact proxy).

Credentials: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` (basic auth) or
``MLFLOW_TRACKING_TOKEN`` (bearer); never printed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from edge.errors import CheckFailed

TAG_PATH, TAG_SHA256, TAG_SIZE = "sim2edge.bundle.path", "sim2edge.bundle.sha256", "sim2edge.bundle.size"


@dataclass(frozen=True)
class BundleRef:
    policy: str
    version: str
    path: str
    sha256: str
    size: int
    run_id: str


def parse_ref(ref: str) -> tuple:
    """``policy@alias`` or ``policy@<version number>`` → (policy, alias or None, version or None)."""
    policy, sep, what = ref.partition("@")
    if not sep or not policy or not what:
        raise ValueError(f"policy reference {ref!r} must look like <policy>@<alias> or <policy>@<version>")
    return (policy, None, what) if what.isdigit() else (policy, what, None)


class RegistryClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = timeout_s

    def _headers(self) -> Dict[str, str]:
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if user and password:
            return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _open(self, path: str, params: Optional[dict] = None):
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        request = urllib.request.Request(url, headers=self._headers())
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            detail = e.read(2000).decode(errors="replace")
            try:
                detail = json.loads(detail).get("message", detail)
            except ValueError:
                pass
            raise CheckFailed("registry", f"{self.base} answered HTTP {e.code} for {path}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise CheckFailed("registry", f"registry {self.base} is unreachable ({reason})") from None

    def _json(self, path: str, params: dict) -> dict:
        with self._open(path, params) as response:
            return json.loads(response.read())

    def resolve(self, ref: str) -> BundleRef:
        """Resolve ``policy@alias`` / ``policy@version`` to the bundle it names."""
        policy, alias, version = parse_ref(ref)
        if alias:
            mv = self._json("/api/2.0/mlflow/registered-models/alias", {"name": policy, "alias": alias})["model_version"]
        else:
            mv = self._json("/api/2.0/mlflow/model-versions/get", {"name": policy, "version": version})["model_version"]
        tags = {t["key"]: t["value"] for t in mv.get("tags", [])}
        missing = [t for t in (TAG_PATH, TAG_SHA256, TAG_SIZE) if t not in tags]
        if missing:
            raise CheckFailed("registry", f"{policy} version {mv['version']} has no bundle (missing tags {missing})")
        return BundleRef(policy, str(mv["version"]), tags[TAG_PATH], tags[TAG_SHA256], int(tags[TAG_SIZE]), mv.get("run_id", ""))

    def download(self, ref: BundleRef, dest: Path) -> None:
        """Stream the bundle to ``dest``; refuse more bytes than declared or a digest mismatch."""
        h = hashlib.sha256()
        received = 0
        with self._open("/api/2.0/mlflow-artifacts/artifacts/" + urllib.parse.quote(ref.path)) as response, \
                open(dest, "wb") as out:
            for chunk in iter(lambda: response.read(1 << 16), b""):
                received += len(chunk)
                if received > ref.size:
                    raise CheckFailed("size", f"download exceeds the declared {ref.size} bytes")
                h.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if received != ref.size:
            raise CheckFailed("size", f"download is {received} bytes, registry declared {ref.size} (truncated)")
        if h.hexdigest() != ref.sha256:
            raise CheckFailed("hash", "downloaded bundle sha256 does not match the registry's")
