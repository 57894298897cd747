"""The MLflow REST contract the device uses, with the standard library only.

1. ``GET /api/2.0/mlflow/registered-models/alias?name=<policy>&alias=<alias>`` or
   ``GET /api/2.0/mlflow/model-versions/get?name=<policy>&version=<n>`` → ``model_version``.
2. The version's tags name the bundle: ``sim2edge.bundle.path`` (path under the artifact
   proxy root), ``sim2edge.bundle.sha256`` and ``sim2edge.bundle.size``.
3. ``GET /api/2.0/mlflow-artifacts/artifacts/<path>`` streams the bundle (artifact proxy).
4. ``watch`` reports the device's state with ``POST /api/2.0/mlflow/registered-models/set-tag``
   (edge/report.py); ``upload`` sends telemetry as runs (edge/telemetry.py).

Every answer is parsed into typed values before any use (edge/registry_answers.py: the name and version asked
for, the bundle's path, sha256 and size; JSON read up to 4 MiB with bounded nesting); anything else is refused
(check ``registry``, or ``size``) naming the field and value.

Transfers retry transient failures (connection refused or dropped, timeouts, HTTP 5xx/429/408,
short bodies) with exponential backoff and full jitter, and resume a partial download with
``Range: bytes=<have>-``. The declared size caps every response: more bytes than declared is
refused, not retried. Every operation runs under one overall deadline and within the registry's origin
(edge/bounded_http.py; :class:`TransferOptions`: ``deadline_s`` for a request, ``deadline_s + size /
min_rate_bps`` for a download). The registry URL itself must be ``http`` or ``https``.

Credentials: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` (basic auth) or
``MLFLOW_TRACKING_TOKEN`` (bearer); never printed, never part of an error message, never sent outside the
registry's origin.
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

from edge.bounded_http import Deadline, opener, origin, redact
from edge.bundle import sha256_path
from edge.errors import CheckFailed, RegistryError, RegistryUnavailable
from edge.registry_answers import BundleRef, bundle_ref, parse_json, parse_ref
from edge.values import shown

CHUNK = 1 << 16
_TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}


class _Transient(Exception):
    """One attempt failed in a way worth retrying."""


@dataclass(frozen=True)
class TransferOptions:
    """Retries, timeouts and the size limit for talking to the registry."""

    attempts: int = 4            # tries per request, the first included
    backoff_base_s: float = 0.5  # delay before retry k is uniform in [0, min(cap, base * 2**k)] (full jitter)
    backoff_cap_s: float = 8.0
    timeout_s: float = 20.0      # per socket operation: connect, and each read
    max_bytes: int = 1 << 30     # refuse a bundle declared (or delivered) larger than this
    deadline_s: float = 120.0    # overall bound on one request with its retries, and a download's fixed part
    min_rate_bps: float = 32768.0  # a download of n bytes may take deadline_s + n / min_rate_bps at most


@dataclass
class DownloadStats:
    attempts: int = 0
    resumed_from: int = 0        # bytes already on disk when the last successful request started
    range_honoured: Optional[bool] = None  # None: no resume was needed


class RegistryClient:
    def __init__(self, base_url: str, options: Optional[TransferOptions] = None,
                 sleep: Callable[[float], None] = time.sleep, rng: Optional[random.Random] = None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.username or parts.password:
            raise ValueError(f"put registry credentials in MLFLOW_TRACKING_USERNAME/PASSWORD, not in the URL "
                             f"{redact(base_url)}")
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ValueError(f"registry URL {shown(base_url)} must be http://host[:port] or https://host[:port]")
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

    def _request(self, deadline: Deadline, path: str, params: Optional[dict] = None,
                 headers: Optional[dict] = None, method: str = "GET", data: Optional[bytes] = None):
        """One HTTP request; raises :class:`_Transient` for retryable failures, CheckFailed otherwise."""
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        request = urllib.request.Request(url, data=data, method=method,
                                         headers=dict(self._headers(), **(headers or {})))
        try:
            return opener(deadline, origin(self.base)).open(request, timeout=max(0.001, min(self.options.timeout_s,
                                                                          deadline.remaining())))
        except urllib.error.HTTPError as e:
            try:
                detail = e.read(2000).decode(errors="replace")
            except (OSError, http.client.HTTPException):
                detail = ""
            try:
                detail = json.loads(detail).get("message", detail)
            except (ValueError, AttributeError):
                pass
            message = f"{self.base} answered HTTP {e.code} for {path}: {str(detail)[:300]}".rstrip(": ")
            if e.code in _TRANSIENT_HTTP:
                raise _Transient(message) from None
            if e.code in (401, 403):
                raise RegistryError(f"{self.base} refused the credentials (HTTP {e.code}) for {path}; "
                                    f"set MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN", e.code) from None
            raise RegistryError(message, e.code) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
            # ValueError: http.client refuses a malformed status line or header from the server
            raise _Transient(f"registry {self.base} is unreachable ({getattr(e, 'reason', e)})") from None

    def _retrying(self, what: str, attempt_fn: Callable[[Deadline, int], object],
                  seconds: Optional[float] = None) -> object:
        """Run ``attempt_fn(deadline, k)`` until it succeeds, the attempts run out (backoff with full jitter)
        or the operation's deadline (``seconds``, default ``deadline_s``) passes."""
        deadline = Deadline(self.options.deadline_s if seconds is None else seconds, what)
        last = ""
        try:
            for k in range(self.options.attempts):
                if k:
                    self._sleep(max(0.0, min(self._delay(k - 1), deadline.remaining())))
                if deadline.passed():
                    raise deadline.error(last)
                try:
                    return attempt_fn(deadline, k)
                except _Transient as e:
                    if deadline.passed():
                        raise deadline.error(str(e)) from None
                    last = str(e)
        finally:
            deadline.cancel()
        if "unreachable" in last:
            raise RegistryUnavailable(f"{last}; {what} failed after {self.options.attempts} attempts")
        raise RegistryUnavailable(f"registry {self.base} is unavailable: {what} failed after "
                                  f"{self.options.attempts} attempts (last: {last})")

    def _json(self, path: str, params: Optional[dict] = None, method: str = "GET",
              body: Optional[object] = None, raw: Optional[bytes] = None) -> dict:
        """A REST call answered with a JSON object, retried on transient failures. ``body`` is sent as JSON,
        ``raw`` as is. An answer that is not a JSON object is refused (check ``registry``)."""
        data = json.dumps(body).encode() if body is not None else raw
        headers = {"Content-Type": "application/json" if body is not None else "application/octet-stream"} \
            if data is not None else None

        def once(deadline: Deadline, _k: int) -> object:
            try:
                with self._request(deadline, path, params, headers, method, data) as response:
                    answer = response.read(1 << 22)
            except (OSError, http.client.HTTPException) as e:
                raise _Transient(f"registry {self.base} is unreachable (connection lost reading {path}: {e})") from None
            try:
                return parse_json(answer, f"{self.base}'s answer to {path}") if answer.strip() else {}
            except ValueError:  # also a body cut by the deadline
                raise _Transient(f"{self.base} answered {path} with {len(answer)} bytes that are not JSON") from None

        answer = self._retrying(f"{method} {path}", once)
        if not isinstance(answer, dict):
            raise CheckFailed("registry", f"{self.base} answered {path} with JSON that is not an object: "
                                          f"{shown(answer)}")
        return answer

    def resolve(self, ref: str) -> BundleRef:
        """Resolve ``policy@alias`` / ``policy@version`` to the bundle it names (parsed by :func:`bundle_ref`)."""
        policy, alias, version = parse_ref(ref)
        if alias:
            answer = self._json("/api/2.0/mlflow/registered-models/alias", {"name": policy, "alias": alias})
        else:
            answer = self._json("/api/2.0/mlflow/model-versions/get", {"name": policy, "version": version})
        return bundle_ref(answer, policy, version, self.options.max_bytes)

    def download(self, ref: BundleRef, part: Path, on_chunk: Optional[Callable[[int], None]] = None) -> DownloadStats:
        """Download the bundle into ``part``, resuming what is already there; verify its size and sha256.

        ``part`` is kept after a transient failure or the deadline (the next call resumes it) and removed
        after a size or digest refusal. ``on_chunk(bytes_on_disk)`` runs after each chunk is written.
        """
        stats = DownloadStats()
        url_path = "/api/2.0/mlflow-artifacts/artifacts/" + urllib.parse.quote(ref.path)

        def once(deadline: Deadline, k: int) -> None:
            stats.attempts = k + 1
            have = part.stat().st_size if part.exists() else 0
            if have > ref.size:
                part.unlink()
                have = 0
            if have == ref.size:
                return
            response = self._request(deadline, url_path, headers={"Range": f"bytes={have}-"} if have else None)
            with response:
                status = response.status
                mode = "wb"
                if have and status == 206:
                    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", response.headers.get("Content-Range", ""))
                    if not match or int(match.group(1)) != have:
                        raise _Transient(f"{self.base} answered a resume from byte {have} with Content-Range "
                                         f"{shown(response.headers.get('Content-Range'))}; starting over")
                    mode, stats.range_honoured = "ab", True
                elif have:
                    # The server ignored Range and sent the whole file (HTTP 200): MLflow's artifact proxy
                    # honours Range for files in a local artifact store (Flask's send_file), but not when
                    # it streams from a remote store through a temporary copy. Fall back to a full download.
                    stats.range_honoured = False
                    have = 0
                stats.resumed_from = have
                length = response.headers.get("Content-Length")
                if length is not None and re.fullmatch(r"[0-9]{1,18}", length) and have + int(length) > ref.size:
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

        o = self.options
        try:
            self._retrying(f"download of {ref.path}", once, o.deadline_s + ref.size / o.min_rate_bps)
        except RegistryUnavailable as e:
            if type(e) is RegistryUnavailable and "truncated" in e.detail:
                if part.exists():
                    part.unlink()
                raise CheckFailed("size", f"download of {ref.path} stayed truncated after {o.attempts} "
                                          f"attempts ({e.detail})") from None
            raise
        if sha256_path(part) != ref.sha256:
            part.unlink()
            raise CheckFailed("hash", f"downloaded bundle {ref.path} sha256 does not match the registry's {ref.sha256[:12]}…")
        return stats
