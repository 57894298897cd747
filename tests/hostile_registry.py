"""An adversarial registry on loopback: it speaks the MLflow REST calls the device agent makes
(edge/registry_client.py, edge/telemetry.py, edge/report.py) and answers whatever a test tells it to.

``routes`` maps a request path (without the query) to the answer: a JSON-able value, or raw ``bytes``.
Artifact downloads (``/api/2.0/mlflow-artifacts/artifacts/<path>``) get ``body``; ``drip_s`` sends it
(or, with ``drip_headers``, the status line and headers) one byte every ``drip_s`` seconds.
``redirects`` maps a request path to a ``Location`` it is answered with (HTTP 302) instead.
``log`` records (method, path) of every request, ``headers`` each request's headers.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.parse

ALIAS = "/api/2.0/mlflow/registered-models/alias"
GET_VERSION = "/api/2.0/mlflow/model-versions/get"
ARTIFACTS = "/api/2.0/mlflow-artifacts/artifacts/"


def model_version(name: str, version: object, path: object, sha256: object, size: object,
                  run_id: object = "0123456789abcdef0123456789abcdef", tags: object = None) -> dict:
    """An alias/version answer as MLflow gives it, with the bundle tags the agent reads (any field may lie)."""
    from edge.registry_answers import TAG_PATH, TAG_SHA256, TAG_SIZE

    if tags is None:
        tags = [{"key": TAG_PATH, "value": path}, {"key": TAG_SHA256, "value": sha256},
                {"key": TAG_SIZE, "value": size}]
    return {"model_version": {"name": name, "version": version, "run_id": run_id, "tags": tags}}


class HostileRegistry:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.routes: dict[str, object] = {}
        self.redirects: dict[str, str] = {}
        self.headers: list[dict[str, str]] = []
        self.body = b""
        self.drip_s = 0.0
        self.drip_headers = False
        self.log: list[tuple[str, str]] = []
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _write(self, data: bytes, drip_s: float) -> None:
                """``data`` at once, or one byte every ``drip_s`` seconds."""
                if not drip_s:
                    return self.wfile.write(data)
                for byte in data:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(drip_s)

            def _send(self, status: int, body: bytes) -> None:
                head = (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                        f"Connection: close\r\n\r\n").encode()
                drip_body = not registry.drip_headers and status == 200 and body is registry.body
                try:
                    self._write(head, registry.drip_s if registry.drip_headers else 0.0)
                    self._write(body, registry.drip_s if drip_body else 0.0)
                except OSError:  # the agent hung up (its deadline)
                    pass
                self.close_connection = True

            def _answer(self) -> None:
                path = urllib.parse.urlsplit(self.path).path
                registry.log.append((self.command, path))
                registry.headers.append(dict(self.headers.items()))
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if path in registry.redirects:
                    self.send_response(302)
                    self.send_header("Location", registry.redirects[path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path.startswith(ARTIFACTS) and self.command == "GET":
                    return self._send(200, registry.body)
                if path not in registry.routes:
                    return self._send(404, b'{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no route"}')
                answer = registry.routes[path]
                self._send(200, answer if isinstance(answer, bytes) else json.dumps(answer).encode())

            do_GET = do_POST = do_PUT = _answer

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def offer(self, answer: object, body: bytes = b"") -> None:
        """Answer both the alias and the version lookup with ``answer``, and downloads with ``body``."""
        self.routes[ALIAS] = self.routes[GET_VERSION] = answer
        self.body = body

    def downloads(self) -> int:
        return sum(1 for _, path in self.log if path.startswith(ARTIFACTS))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
