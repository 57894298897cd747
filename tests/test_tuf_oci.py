"""`sim2edge publish … --oci REGISTRY/NAME[:TAG]`: the TUF repository pushed as an OCI artifact to Debian's
docker-registry on loopback, pulled back with oras-py into a directory that nginx serves, and a device installing
from that copy through TUF as from the original."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.bundles import make_bundle, make_keys
from tests.bundles import publish as register
from tests.conftest import free_port, run_cli
from tests.servers import start_nginx, stop_nginx

pytestmark = pytest.mark.skipif(shutil.which("docker-registry") is None or shutil.which("nginx") is None,
                                reason="needs Debian's docker-registry and nginx (make docker nginx)")


@pytest.fixture(scope="module")
def oci_registry(tmp_path_factory):
    """docker-registry as this test's own process on a loopback port; yields its host:port."""
    d = tmp_path_factory.mktemp("oci")
    port = free_port()
    (d / "config.yml").write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {d}/data\n"
                                  f"http:\n  addr: 127.0.0.1:{port}\n")
    with (d / "registry.log").open("wb") as log:
        proc = subprocess.Popen([shutil.which("docker-registry"), "serve", str(d / "config.yml")], stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (d / "registry.log").read_text()
            time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def served(tmp_path):
    """nginx serving ``<tmp>/www``: (www, base URL)."""
    d, port = tmp_path / "nginx", free_port()
    d.mkdir()
    proc = start_nginx(d, port)
    yield d / "www", f"http://127.0.0.1:{port}"
    stop_nginx(d, proc)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_pushed_copy_is_the_repository_and_devices_install_from_it(oci_registry, served, tmp_path, mlflow_server):
    import oras.client
    from mlflow.tracking import MlflowClient

    priv, pub = make_keys(tmp_path)
    tar = tmp_path / "ocitiny-1.tar"
    make_bundle(tar, priv, version="1", name="ocitiny")
    assert register(mlflow_server, tar, "ocitiny", "champion") == "1"
    repo, ref = tmp_path / "tuf", f"{oci_registry}/fleet/tuf:v1"
    done = run_cli("sim2edge", "publish", "ocitiny@champion", "--repo", str(repo), "--keys", str(tmp_path / "keys"),
                   "--oci", ref, "--plain-http")
    assert done.returncode == 0, done.stdout + done.stderr
    pinned = MlflowClient(mlflow_server).get_model_version("ocitiny", "1").tags["sim2edge.oci"]
    assert pinned.startswith(f"{oci_registry}/fleet/tuf@sha256:") and f"pushed {pinned}" in done.stdout

    client = oras.client.OrasClient(insecure=True)
    manifest = client.get_manifest(pinned)
    assert manifest["annotations"]["dev.sim2edge.policy"] == "ocitiny"
    assert manifest["annotations"]["dev.sim2edge.version"] == "1"
    assert manifest["layers"][0]["annotations"]["io.deis.oras.content.unpack"] == "true"
    www, base = served
    (copy,) = client.pull(ref, outdir=str(www))
    assert files(Path(copy)) == files(repo)  # every metadata file and target, byte for byte

    root = tmp_path / "store"
    r = run_cli("sim2edge-agent", "pull", "ocitiny", "--tuf", f"{base}/{Path(copy).name}", "--tuf-root",
                str(repo / "metadata/root.json"), "--root", str(root), "--trust", str(pub), "--skip-target-check",
                "--attempts", "1", "--backoff", "0", "--ignore-backoff")
    assert r.returncode == 0 and "activated ocitiny v1" in r.stdout, r.stderr


@pytest.mark.parametrize("reference, message", [
    ("fleet/tuf", r"--oci 'fleet/tuf': give REGISTRY\[:PORT\]/NAME\[:TAG\]"),
    ("127.0.0.1:5000/Fleet", r"--oci '127.0.0.1:5000/Fleet': give REGISTRY"),
])
def test_a_bad_reference_is_refused_before_anything_is_published(tmp_path, reference, message):
    r = run_cli("sim2edge", "publish", "x@champion", "--repo", str(tmp_path / "tuf"), "--oci", reference,
                env={"SIM2EDGE_HOME": str(tmp_path / "home"), "COLUMNS": "200"})
    assert r.returncode == 2 and len(r.stdout.strip().splitlines()) == 1, r.stdout + r.stderr
    assert re.search(message, r.stdout), r.stdout
    assert not (tmp_path / "tuf").exists()


def test_an_unreachable_registry_says_the_repository_was_published_but_not_pushed(tmp_path, mlflow_server):
    priv, _ = make_keys(tmp_path)
    tar = tmp_path / "ocidead-1.tar"
    make_bundle(tar, priv, version="1", name="ocidead")
    register(mlflow_server, tar, "ocidead", "champion")
    r = run_cli("sim2edge", "publish", "ocidead@champion", "--repo", str(tmp_path / "tuf"), "--keys",
                str(tmp_path / "keys"), "--oci", f"127.0.0.1:{free_port()}/fleet/tuf", "--plain-http",
                env={"COLUMNS": "250"})
    assert r.returncode == 2 and len(r.stdout.strip().splitlines()) == 1, r.stdout + r.stderr
    assert f"published ocidead v1 to {tmp_path / 'tuf'}, but not pushed: --oci: no registry answers at http://127.0.0.1:" in r.stdout
    assert (tmp_path / "tuf" / "metadata" / "timestamp.json").exists()
