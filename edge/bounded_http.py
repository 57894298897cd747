"""HTTP under one deadline, within one origin: the transport the registry client (and TUF's fetcher) use.

Besides the per-read timeout, an operation has an overall :class:`Deadline`: when it passes, every socket the
operation opened is shut down, so a server that answers one byte at a time cannot hold the agent (or the store's
lock) longer than that (check ``deadline``). Redirects are followed only within the origin (scheme, host and port)
through the same connections and under the same deadline; a redirect anywhere else is refused (check
``registry``) before anything is sent there, so credentials never leave the origin.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse
import urllib.request
from typing import List, Tuple

from edge.errors import CheckFailed, TransferDeadline
from edge.values import shown


class Deadline:
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


def origin(url: str) -> Tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, the port made explicit; ("", "", 0) for a malformed one."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return "", "", 0


class SameOrigin(urllib.request.HTTPRedirectHandler):
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


def opener(deadline: Deadline, allowed: Tuple[str, str, int]) -> urllib.request.OpenerDirector:
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

    return urllib.request.build_opener(Handler, TLSHandler, SameOrigin(allowed))


def redact(url: str) -> str:
    """``url`` without any ``user:password@`` part, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
