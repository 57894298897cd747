"""The MLflow REST contract the device uses, with the standard library only.

1. ``GET /api/2.0/mlflow/registered-models/alias?name=<policy>&alias=<alias>`` or
   ``GET /api/2.0/mlflow/model-versions/get?name=<policy>&version=<n>`` → ``model_version``.
2. The version's tags name the bundle: ``sim2edge.bundle.path`` (path under the artifact
   proxy root), ``sim2edge.bundle.sha256`` and ``sim2edge.bundle.size``.
3. ``GET /api/2.0/mlflow-artifacts/artifacts/<path>`` streams the bundle (artifact proxy).
4. ``watch`` reports the device's state with ``POST /api/2.0/mlflow/registered-models/set-tag``
   (edge/report.py); ``upload`` sends telemetry as runs (edge/telemetry.py).

Transfers retry transient failures (connection refused or dropped, timeouts, HTTP 5xx/429/408,
short bodies) with exponential backoff and full jitter, and resume a partial download with
``Range: bytes=<have>-``. The declared size (the version's ``sim2edge.bundle.size`` tag, bounded
by a configured maximum) caps every response: more bytes than declared is refused, not retried.

Credentials: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` (basic auth) or
``MLFLOW_TRACKING_TOKEN`` (bearer); never printed, never part of an error message.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

from edge.bundle import sha256_path
from edge.errors import CheckFailed

TAG_PATH, TAG_SHA256, TAG_SIZE = "sim2edge.bundle.path", "sim2edge.bundle.sha256", "sim2edge.bundle.size"
CHUNK = 1 << 16
_TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}


class RegistryUnavailable(CheckFailed):
    """The registry could not be reached, or kept failing, after every retry (the caller backs off)."""

    def __init__(self, detail: str) -> None:
        super().__init__("registry", detail)


class RegistryError(CheckFailed):
    """The registry answered with an HTTP error that retrying will not fix (``status`` holds the code)."""

    def __init__(self, detail: str, status: int) -> None:
        super().__init__("registry", detail)
        self.status = status


class _Transient(Exception):
    """One attempt failed in a way worth retrying."""


@dataclass(frozen=True)
class BundleRef:
    policy: str
    version: str
    path: str
    sha256: str
    size: int
    run_id: str


@dataclass(frozen=True)
class TransferOptions:
    """Retries, timeouts and the size limit for talking to the registry."""

    attempts: int = 4            # tries per request, the first included
    backoff_base_s: float = 0.5  # delay before retry k is uniform in [0, min(cap, base * 2**k)] (full jitter)
    backoff_cap_s: float = 8.0
    timeout_s: float = 20.0      # per socket operation: connect, and each read
    max_bytes: int = 1 << 30     # refuse a bundle declared (or delivered) larger than this


@dataclass
class DownloadStats:
    attempts: int = 0
    resumed_from: int = 0        # bytes already on disk when the last successful request started
    range_honoured: Optional[bool] = None  # None: no resume was needed


def parse_ref(ref: str) -> tuple:
    """``policy@alias`` or ``policy@<version number>`` → (policy, alias or None, version or None)."""
    policy, sep, what = ref.partition("@")
    if not sep or not policy or not what:
        raise ValueError(f"policy reference {ref!r} must look like <policy>@<alias> or <policy>@<version>")
    return (policy, None, what) if what.isdigit() else (policy, what, None)


def redact(url: str) -> str:
    """``url`` without any ``user:password@`` part, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RegistryClient:
    def __init__(self, base_url: str, options: Optional[TransferOptions] = None,
                 sleep: Callable[[float], None] = time.sleep, rng: Optional[random.Random] = None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.username or parts.password:
            raise ValueError(f"put registry credentials in MLFLOW_TRACKING_USERNAME/PASSWORD, not in the URL "
                             f"{redact(base_url)}")
        self.base = base_url.rstrip("/")
        self.options = options or TransferOptions()
        self._sleep = sleep
        self._rng = rng or random.Random()

    def _headers(self) -> Dict[str, str]:
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if user and password:
            return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _delay(self, attempt: int) -> float:
        o = self.options
        return self._rng.uniform(0.0, min(o.backoff_cap_s, o.backoff_base_s * (2 ** attempt)))

    def _request(self, path: str, params: Optional[dict] = None, headers: Optional[dict] = None,
                 method: str = "GET", data: Optional[bytes] = None):
        """One HTTP request; raises :class:`_Transient` for retryable failures, CheckFailed otherwise."""
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        request = urllib.request.Request(url, data=data, method=method,
                                         headers=dict(self._headers(), **(headers or {})))
        try:
            return urllib.request.urlopen(request, timeout=self.options.timeout_s)
        except urllib.error.HTTPError as e:
            try:
                detail = e.read(2000).decode(errors="replace")
            except (OSError, http.client.HTTPException):
                detail = ""
            try:
                detail = json.loads(detail).get("message", detail)
            except (ValueError, AttributeError):
                pass
            message = f"{self.base} answered HTTP {e.code} for {path}: {detail[:300]}".rstrip(": ")
            if e.code in _TRANSIENT_HTTP:
                raise _Transient(message) from None
            if e.code in (401, 403):
                raise CheckFailed("registry", f"{self.base} refused the credentials (HTTP {e.code}) for {path}; "
                                              f"set MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN") from None
            raise RegistryError(message, e.code) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise _Transient(f"registry {self.base} is unreachable ({getattr(e, 'reason', e)})") from None

    def _retrying(self, what: str, attempt_fn: Callable[[int], object]) -> object:
        """Run ``attempt_fn(k)`` until it succeeds or the attempts run out (backoff with full jitter)."""
        last = ""
        for k in range(self.options.attempts):
            if k:
                self._sleep(self._delay(k - 1))
            try:
                return attempt_fn(k)
            except _Transient as e:
                last = str(e)
        if "unreachable" in last:
            raise RegistryUnavailable(f"{last}; {what} failed after {self.options.attempts} attempts")
        raise RegistryUnavailable(f"registry {self.base} is unavailable: {what} failed after "
                                  f"{self.options.attempts} attempts (last: {last})")

    def _json(self, path: str, params: Optional[dict] = None, method: str = "GET",
              body: Optional[object] = None, raw: Optional[bytes] = None) -> dict:
        """A REST call answered with JSON, retried on transient failures. ``body`` is sent as JSON, ``raw`` as is."""
        data = json.dumps(body).encode() if body is not None else raw
        headers = {"Content-Type": "application/json" if body is not None else "application/octet-stream"} \
            if data is not None else None

        def once(_k: int) -> dict:
            try:
                with self._request(path, params, headers, method, data) as response:
                    answer = response.read(1 << 22)
            except (OSError, http.client.HTTPException) as e:
                raise _Transient(f"registry {self.base} is unreachable (connection lost reading {path}: {e})") from None
            try:
                return json.loads(answer) if answer.strip() else {}
            except ValueError:
                raise _Transient(f"{self.base} answered {path} with {len(answer)} bytes that are not JSON") from None

        return self._retrying(f"{method} {path}", once)  # type: ignore[return-value]

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

    def download(self, ref: BundleRef, part: Path, on_chunk: Optional[Callable[[int], None]] = None) -> DownloadStats:
        """Download the bundle into ``part``, resuming what is already there; verify its size and sha256.

        ``part`` is kept after a transient failure (the next call resumes it) and removed after a
        size or digest refusal. ``on_chunk(bytes_on_disk)`` runs after each chunk is written.
        """
        limit = self.options.max_bytes
        if ref.size > limit:
            raise CheckFailed("size", f"{ref.policy} v{ref.version} is declared {ref.size} bytes, over this device's "
                                      f"limit of {limit} bytes")
        stats = DownloadStats()
        url_path = "/api/2.0/mlflow-artifacts/artifacts/" + urllib.parse.quote(ref.path)

        def once(k: int) -> None:
            stats.attempts = k + 1
            have = part.stat().st_size if part.exists() else 0
            if have > ref.size:
                part.unlink()
                have = 0
            if have == ref.size:
                return
            response = self._request(url_path, headers={"Range": f"bytes={have}-"} if have else None)
            with response:
                status = response.status
                mode = "wb"
                if have and status == 206:
                    match = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", response.headers.get("Content-Range", ""))
                    if not match or int(match.group(1)) != have:
                        raise _Transient(f"{self.base} answered a resume from byte {have} with Content-Range "
                                         f"{response.headers.get('Content-Range')!r}; starting over")
                    mode, stats.range_honoured = "ab", True
                elif have:
                    # The server ignored Range and sent the whole file (HTTP 200): MLflow's artifact proxy
                    # honours Range for files in a local artifact store (Flask's send_file), but not when
                    # it streams from a remote store through a temporary copy. Fall back to a full download.
                    stats.range_honoured = False
                    have = 0
                stats.resumed_from = have
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and have + int(length) > ref.size:
                    if part.exists():
                        part.unlink()
                    raise CheckFailed("size", f"{self.base} offers {have + int(length)} bytes for {ref.path}, "
                                              f"registry declared {ref.size} (oversized response refused)")
                received = have
                with open(part, mode) as out:
                    while True:
                        try:
                            chunk = response.read(CHUNK)
                        except (OSError, http.client.HTTPException) as e:
                            out.flush()
                            os.fsync(out.fileno())
                            raise _Transient(f"registry {self.base} is unreachable (connection lost after "
                                             f"{received} of {ref.size} bytes: {e!r})") from None
                        if not chunk:
                            break
                        received += len(chunk)
                        if received > ref.size:
                            out.close()
                            part.unlink()
                            raise CheckFailed("size", f"download of {ref.path} exceeds the declared {ref.size} bytes "
                                                      f"(oversized response refused)")
                        out.write(chunk)
                        if on_chunk is not None:
                            out.flush()
                            on_chunk(received)
                    out.flush()
                    os.fsync(out.fileno())
            if received < ref.size:
                raise _Transient(f"{self.base} sent {received} of {ref.size} bytes for {ref.path} (truncated); resuming")

        try:
            self._retrying(f"download of {ref.path}", once)
        except RegistryUnavailable as e:
            if "truncated" in e.detail:
                raise CheckFailed("size", f"download of {ref.path} stayed truncated after {self.options.attempts} "
                                          f"attempts ({e.detail})") from None
            raise
        if sha256_path(part) != ref.sha256:
            part.unlink()
            raise CheckFailed("hash", f"downloaded bundle {ref.path} sha256 does not match the registry's {ref.sha256[:12]}…")
        return stats

