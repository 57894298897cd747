"""The MLflow REST contract the device uses, with the standard library only.

1. ``GET /api/2.0/mlflow/registered-models/alias?name=<policy>&alias=<alias>`` or
   ``GET /api/2.0/mlflow/model-versions/get?name=<policy>&version=<n>`` → ``model_version``.
2. The version's tags name the bundle: ``sim2edge.bundle.path`` (path under the artifact
   proxy root), ``sim2edge.bundle.sha256`` and ``sim2edge.bundle.size``.
3. ``GET /api/2.0/mlflow-artifacts/artifacts/<path>`` streams the bundle (artifact proxy).
4. ``watch`` reports the device's state with ``POST /api/2.0/mlflow/registered-models/set-tag``
   (edge/report.py); ``upload`` sends telemetry as runs (edge/telemetry.py).

Every answer is parsed into typed values (edge/values.py) by :func:`bundle_ref` before any use: the
version must be a positive integer (and the one asked for), the name the one asked for, the sha256
64 lowercase hex digits, the size a byte count within the device's limit, the path relative and
normalized; anything else is refused (check ``registry``, or ``size``) naming the field and value.

Transfers retry transient failures (connection refused or dropped, timeouts, HTTP 5xx/429/408,
short bodies) with exponential backoff and full jitter, and resume a partial download with
``Range: bytes=<have>-``. The declared size caps every response: more bytes than declared is
refused, not retried. Besides the per-read timeout, every operation has an overall deadline
(:class:`TransferOptions`: ``deadline_s`` for a request, ``deadline_s + size / min_rate_bps`` for a
download): when it passes, the connection's socket is shut down, so a server that answers one
byte at a time cannot hold the agent (or the store's lock) longer than that (check ``deadline``).

Credentials: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` (basic auth) or
``MLFLOW_TRACKING_TOKEN`` (bearer); never printed, never part of an error message.

Redirects are followed only within the registry's origin (scheme, host and port of ``--registry``),
through the same connections and under the same deadline; a redirect anywhere else (another host,
port or scheme: ``ftp:``, ``file:``, ``data:``) is refused (check ``registry``) before anything is
sent there, so credentials never leave the origin. The registry URL itself must be ``http`` or ``https``.

JSON answers are read up to 4 MiB and parsed with bounded nesting (:data:`MAX_JSON_DEPTH`); an
integer too long for any field the agent reads stays text, so the typed parsers refuse it
(``registry``) instead of the JSON parser failing as if the answer were cut short.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from edge.bundle import sha256_path
from edge.errors import CheckFailed
from edge.values import ID, ArtifactPath, PolicyName, Sha256, Version, byte_count, shown

TAG_PATH, TAG_SHA256, TAG_SIZE = "sim2edge.bundle.path", "sim2edge.bundle.sha256", "sim2edge.bundle.size"
CHUNK = 1 << 16
_TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}
_ALIAS = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,254}")
MAX_JSON_DEPTH = 32
"""Nesting of objects and arrays in a registry answer (MLflow's are at most 4 deep)."""
_MAX_INT_DIGITS = 19


class RegistryUnavailable(CheckFailed):
    """The registry could not be reached, or kept failing, after every retry (the caller backs off)."""

    def __init__(self, detail: str, check: str = "registry") -> None:
        super().__init__(check, detail)


class TransferDeadline(RegistryUnavailable):
    """An operation outlived its overall deadline (a stalled or dripping server); counted as unavailable."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, "deadline")


class RegistryError(CheckFailed):
    """The registry answered with an HTTP error that retrying will not fix (``status`` holds the code)."""

    def __init__(self, detail: str, status: int) -> None:
        super().__init__("registry", detail)
        self.status = status


class _Transient(Exception):
    """One attempt failed in a way worth retrying."""


@dataclass(frozen=True)
class BundleRef:
    """What the registry says a version's bundle is: every field parsed (see :func:`bundle_ref`)."""

    policy: PolicyName
    version: Version
    path: ArtifactPath
    sha256: Sha256
    size: int
    run_id: str
    directed: bool = False
    """A signed rollout plan names this version for the device (edge/rollout_plan.py): it may be older than the
    active one (a halted ring rolls back); TUF's own rollback protection keeps an old plan from being replayed."""


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


def parse_ref(ref: str) -> Tuple[PolicyName, Optional[str], Optional[Version]]:
    """``policy@alias`` or ``policy@<version number>`` → (policy, alias or None, version or None)."""
    policy, sep, what = ref.partition("@")
    usage = f"policy reference {shown(ref)} must look like <policy>@<alias> or <policy>@<version>"
    if not sep or not policy or not what:
        raise ValueError(usage)
    try:
        name = PolicyName.parse(policy, check="reference")
        if re.fullmatch(r"[0-9]+", what):
            return name, None, Version.parse(what, check="reference")
    except CheckFailed as e:
        raise ValueError(f"{usage}: {e.detail}") from None
    if not _ALIAS.fullmatch(what):
        raise ValueError(f"{usage}: alias {shown(what)} is not an MLflow alias name")
    return name, what, None


def bundle_ref(answer: object, policy: PolicyName, version: Optional[Version], max_bytes: int) -> BundleRef:
    """Parse a ``model_version`` answer (alias or version lookup) into a :class:`BundleRef`, or refuse it."""
    where = f"{policy}@{version}" if version else policy
    mv = answer.get("model_version") if isinstance(answer, dict) else None
    if not isinstance(mv, dict):
        raise CheckFailed("registry", f"the answer for {where} has no model_version object: {shown(answer)}")
    if "name" in mv and mv["name"] != policy:
        raise CheckFailed("registry", f"asked for {policy}, the registry answered model {shown(mv['name'])}")
    got = Version.parse(mv.get("version"), f"model_version.version of {where}")
    if version is not None and got != version:
        raise CheckFailed("registry", f"asked for {policy} v{version}, the registry answered v{got}")
    raw_tags = mv.get("tags", [])
    if not isinstance(raw_tags, list) or not all(
            isinstance(t, dict) and isinstance(t.get("key"), str) and isinstance(t.get("value"), str) for t in raw_tags):
        raise CheckFailed("registry", f"tags of {policy} v{got} are not a list of string key/value pairs: "
                                      f"{shown(raw_tags)}")
    tags = {t["key"]: t["value"] for t in raw_tags}
    missing = [t for t in (TAG_PATH, TAG_SHA256, TAG_SIZE) if t not in tags]
    if missing:
        raise CheckFailed("registry", f"{policy} version {got} has no bundle (missing tags {missing})")
    size = byte_count(tags[TAG_SIZE], f"tag {TAG_SIZE} of {policy} v{got}", max_bytes)
    if size == 0:
        raise CheckFailed("registry", f"tag {TAG_SIZE} of {policy} v{got} declares an empty bundle")
    run_id = mv.get("run_id") or ""
    if not isinstance(run_id, str) or (run_id and not ID.fullmatch(run_id)):
        raise CheckFailed("registry", f"run_id of {policy} v{got} {shown(run_id)} is not a run id")
    return BundleRef(policy, got, ArtifactPath.parse(tags[TAG_PATH], f"tag {TAG_PATH} of {policy} v{got}"),
                     Sha256.parse(tags[TAG_SHA256], f"tag {TAG_SHA256} of {policy} v{got}"), size, run_id)


class _Deadline:
    """The overall bound on one operation: when it passes, every socket the operation opened is shut down,
    so no read (of headers or body, however slowly the server drips) blocks beyond it."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.at = time.monotonic() + seconds
        self.fired = False
        self._sockets: List[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def register(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.fired:
                sock.shutdown(socket.SHUT_RDWR)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def passed(self) -> bool:
        return self.fired or self.remaining() <= 0

    def error(self, last: str = "") -> TransferDeadline:
        return TransferDeadline(f"{self.what} did not finish within its deadline of {self.seconds:.0f} s"
                                + (f" (last: {last})" if last else ""))

    def cancel(self) -> None:
        self._timer.cancel()


def parse_json(data: bytes, what: str) -> object:
    """``data`` as JSON, refused (check ``registry``) if nested deeper than :data:`MAX_JSON_DEPTH`; an integer
    of more than 19 digits stays its text. Raises ``ValueError`` for bytes that are not JSON."""
    try:
        value = json.loads(data, parse_int=lambda t: int(t) if len(t) <= _MAX_INT_DIGITS else t)
    except RecursionError:
        value, depth = None, MAX_JSON_DEPTH + 1
    else:
        depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise CheckFailed("registry", f"{what} is JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def json_depth(value: object) -> int:
    """How deeply objects and arrays nest in a parsed JSON ``value`` (a scalar is 0); iterative."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def origin(url: str) -> Tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, the port made explicit; ("", "", 0) for a malformed one."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return "", "", 0


class _SameOrigin(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to ``allowed`` (the registry's origin); any other target is refused unsent."""

    def __init__(self, allowed: Tuple[str, str, int]) -> None:
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if origin(newurl) != self.allowed:
            fp.close()
            scheme, host, port = self.allowed
            raise CheckFailed("registry", f"{redact(req.full_url)} redirected (HTTP {code}) to "
                                          f"{shown(redact(newurl))}, outside the registry's origin "
                                          f"{scheme}://{host}:{port}; not followed (credentials stay with the registry)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(deadline: _Deadline, allowed: Tuple[str, str, int]) -> urllib.request.OpenerDirector:
    """urllib with connections whose sockets ``deadline`` can shut down (proxies and TLS as usual) and
    redirects followed within ``allowed`` only."""

    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            deadline.register(self.sock)

    class TLSConnection(http.client.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            deadline.register(self.sock)

    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req):  # type: ignore[no-untyped-def]
            return self.do_open(Connection, req)

    class TLSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):  # type: ignore[no-untyped-def]
            extra = {"check_hostname": self._check_hostname} if hasattr(self, "_check_hostname") else {}
            return self.do_open(TLSConnection, req, context=self._context, **extra)

    return urllib.request.build_opener(Handler, TLSHandler, _SameOrigin(allowed))


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

    def _request(self, deadline: _Deadline, path: str, params: Optional[dict] = None,
                 headers: Optional[dict] = None, method: str = "GET", data: Optional[bytes] = None):
        """One HTTP request; raises :class:`_Transient` for retryable failures, CheckFailed otherwise."""
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        request = urllib.request.Request(url, data=data, method=method,
                                         headers=dict(self._headers(), **(headers or {})))
        try:
            return _opener(deadline, origin(self.base)).open(request, timeout=max(0.001, min(self.options.timeout_s,
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

    def _retrying(self, what: str, attempt_fn: Callable[[_Deadline, int], object],
                  seconds: Optional[float] = None) -> object:
        """Run ``attempt_fn(deadline, k)`` until it succeeds, the attempts run out (backoff with full jitter)
        or the operation's deadline (``seconds``, default ``deadline_s``) passes."""
        deadline = _Deadline(self.options.deadline_s if seconds is None else seconds, what)
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

        def once(deadline: _Deadline, _k: int) -> object:
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

        def once(deadline: _Deadline, k: int) -> None:
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
