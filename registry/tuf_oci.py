"""A copy of a TUF repository as an OCI artifact: ``sim2edge publish … --oci REGISTRY/NAME[:TAG]``.

The whole repository directory (``metadata/`` and ``targets/``; the keys never live there) goes as one
``tar+gzip`` layer titled with the directory's name and marked ``io.deis.oras.content.unpack``, the layout the
``oras`` CLI uses for a directory, so ``oras pull`` (or ``oras-py``) unpacks it where an HTTP server can serve it
again. TUF's signatures travel inside: a copy served from anywhere is verified by devices exactly as the original.
The manifest names the policy and version it was pushed for. Pushed with ``oras-py`` (the OCI distribution API);
anonymous, as Debian's ``docker-registry`` on loopback takes it, over plain HTTP only when asked.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel

REFERENCE = re.compile(r"^(?P<registry>[A-Za-z0-9.-]+(:\d{1,5})?)/(?P<name>[a-z0-9]+(?:[._/-][a-z0-9]+)*)"
                       r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?$")
UNPACK = "io.deis.oras.content.unpack"


class OciPushed(BaseModel):
    reference: str
    digest: str

    @property
    def pinned(self) -> str:
        """``REGISTRY/NAME@sha256:…``: the pushed manifest, whatever the tag points to later."""
        return f"{self.reference.rsplit(':', 1)[0]}@{self.digest}"  # ``reference`` always ends in its tag


def check_reference(reference: str) -> str:
    """``reference`` with ``:latest`` added when it has no tag; ValueError in one line when it is not
    ``REGISTRY[:PORT]/NAME[:TAG]``."""
    m = REFERENCE.match(reference)
    if m is None or not ("." in m["registry"] or ":" in m["registry"] or m["registry"] == "localhost"):  # Docker's rule
        raise ValueError(f"--oci {reference!r}: give REGISTRY[:PORT]/NAME[:TAG], e.g. registry.lab:5000/fleet/tuf:v7")
    return reference if m["tag"] else f"{reference}:latest"


def push_repository(repo: Path, reference: str, policy: str, version: str, plain_http: bool = False) -> OciPushed:
    """Push the TUF repository ``repo`` as one OCI artifact at ``reference``; ValueError in one line when the
    registry is unreachable or refuses it."""
    import oras.client
    import requests

    target = check_reference(reference)
    if not (repo / "metadata" / "timestamp.json").is_file():
        raise ValueError(f"--oci: {repo} is not a TUF repository written by `sim2edge publish` (no metadata/timestamp.json)")
    _answers(target.split("/", 1)[0], plain_http)
    client = oras.client.OrasClient(insecure=plain_http)
    annotations = {"org.opencontainers.image.created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   "dev.sim2edge.policy": policy, "dev.sim2edge.version": version}
    try:
        client.push(target, files=[str(repo.resolve())], disable_path_validation=True,
                    manifest_annotations=annotations, quiet=True)
        manifest = client.get_manifest(target)
        for layer in manifest["layers"]:  # oras-py leaves out the CLI's unpack mark
            layer["annotations"][UNPACK] = "true"
        response = client.upload_manifest(manifest, client.get_container(target))
    except (requests.RequestException, ValueError, OSError) as e:
        raise ValueError(f"--oci {target}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'refused'}") \
            from None
    if response.status_code not in (200, 201):
        raise ValueError(f"--oci {target}: the registry answered {response.status_code} to the manifest")
    return OciPushed(reference=target, digest=response.headers["Docker-Content-Digest"])


def _answers(registry: str, plain_http: bool, timeout_s: float = 5.0) -> None:
    """One ``GET /v2/`` (the distribution API's base: 200, or 401 asking for a login) before pushing: oras-py retries
    a dead registry for over two minutes."""
    import requests

    url = f"{'http' if plain_http else 'https'}://{registry}/v2/"
    try:
        status = requests.get(url, timeout=timeout_s).status_code
    except requests.RequestException as e:
        raise ValueError(f"--oci: no registry answers at {url} ({type(e).__name__})") from None
    if status not in (200, 401):
        raise ValueError(f"--oci: {url} answered {status}, not an OCI registry's 200 or 401")
