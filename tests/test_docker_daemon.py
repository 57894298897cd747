"""Images against a real Docker daemon: the worker image builds on a locally made base, runs `sim2edge --help` in a
container and is pushed to a local registry. The session fixture starts dockerd (vfs storage, classic builder) and
Debian's docker-registry on loopback itself; every test here skips, saying why, where they cannot start.

No public image registry is reachable, so the base image is imported from a tarball of a minimal root file system
made from this host: its CPython (stdlib pruned of tests, GUI and bytecode), the shared libraries it links, /bin/sh,
pip + setuptools and the packages `sim2edge --help` imports, copied from this venv (~60 MB; vfs copies every layer)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parent.parent
HELP_PACKAGES = ("typer", "rich", "pygments", "markdown_it", "mdurl", "shellingham", "pydantic", "pydantic_core",
                 "annotated_types", "annotated_doc", "typing_extensions", "typing_inspection", "pip", "setuptools",
                 "_distutils_hack", "distutils-precedence.pth")
PRUNE = {"test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "__pycache__",
         "site-packages", "unittest", "distutils"}


def _wait(predicate, timeout_s: float, what: str, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    pytest.skip(f"{what} did not start within {timeout_s:.0f} s: {log.read_text()[-500:] if log.exists() else ''}")


@pytest.fixture(scope="session")
def docker_env(tmp_path_factory):
    """dockerd + docker-registry for this session; yields (Docker SDK client, registry host:port)."""
    dockerd, registry_bin = shutil.which("dockerd"), shutil.which("docker-registry")
    if not dockerd or not registry_bin:
        pytest.skip("dockerd or docker-registry is not installed (as root: apt-get install -y docker.io docker-registry)")
    if os.geteuid() != 0:
        pytest.skip("dockerd needs root here")
    import docker

    # a short path: the daemon's unix sockets must stay under 108 characters
    root = Path("/tmp") / f"s2e-docker-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    sock, log = root / "docker.sock", root / "dockerd.log"
    daemon = subprocess.Popen([dockerd, "--storage-driver=vfs", f"--data-root={root / 'data'}",
                               f"--exec-root={root / 'exec'}", f"--pidfile={root / 'docker.pid'}", "-H", f"unix://{sock}"],
                              stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    port = free_port()
    (root / "registry.yml").write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root / 'registry'}\n"
                                       f"http:\n  addr: 127.0.0.1:{port}\n")
    reg_log = root / "registry.log"
    registry = subprocess.Popen([registry_bin, "serve", str(root / "registry.yml")], stdout=open(reg_log, "wb"),
                                stderr=subprocess.STDOUT)
    client = None
    try:
        def daemon_up():
            nonlocal client
            if daemon.poll() is not None:
                pytest.skip(f"dockerd exited with {daemon.returncode}: {log.read_text()[-500:]}")
            try:
                client = docker.DockerClient(base_url=f"unix://{sock}", timeout=300)
                return client.ping()
            except docker.errors.DockerException:
                return False

        _wait(daemon_up, 60, "dockerd", log)

        def registry_up():
            import urllib.request

            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2).status == 200
            except OSError:
                return False

        _wait(registry_up, 30, "docker-registry", reg_log)
        yield client, f"127.0.0.1:{port}"
    finally:
        if client is not None:
            client.close()
        for proc in (registry, daemon):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def _shared_libs(binaries) -> set[Path]:
    """Every shared library (and the loader) the given ELF files need, per ldd."""
    libs = set()
    for b in binaries:
        out = subprocess.run(["ldd", str(b)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            for p in parts:
                if p.startswith("/") and Path(p).exists():
                    libs.add(Path(p))
    return libs


def minimal_rootfs_tar(out: Path) -> Path:
    """A tarball: /usr/local/bin/python3 (this interpreter), its pruned stdlib, libs, /bin/sh, the --help packages."""
    prefix = Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_paths(vars={"base": str(prefix), "platbase": str(prefix)})["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    exe = Path(os.path.realpath(prefix / "bin" / version))
    libpython = [p for p in (prefix / "lib").glob("libpython3*.so*") if p.is_file() and not p.is_symlink()]
    dynload = list((stdlib / "lib-dynload").glob("*.so"))
    sh = Path(os.path.realpath("/bin/sh"))
    native = [so for pkg in HELP_PACKAGES for path in site.glob(pkg) if path.is_dir() for so in path.rglob("*.so")]
    libs = _shared_libs([exe, sh, *dynload, *native])

    def skip(info: tarfile.TarInfo):
        parts = set(Path(info.name).parts)
        return None if parts & PRUNE or info.name.endswith((".pyc", ".a")) else info

    with tarfile.open(out, "w") as tar:
        for d in ("tmp", "workspace", "etc", "usr/local/lib"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(exe, f"usr/local/bin/{version}")
        for name in ("python3", "python"):
            link = tarfile.TarInfo(f"usr/local/bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, version
            tar.addfile(link)
        for lib in libpython:
            tar.add(lib, f"usr/local/lib/{lib.name}")
            for alias in {lib.name.split(".so")[0] + ".so", lib.name.rsplit(".", 1)[0]} - {lib.name}:
                link = tarfile.TarInfo(f"usr/local/lib/{alias}")
                link.type, link.linkname = tarfile.SYMTYPE, lib.name
                tar.addfile(link)
        tar.add(stdlib, f"usr/local/lib/{version}", filter=skip)
        for pkg in HELP_PACKAGES:
            for path in [*site.glob(pkg), *site.glob(f"{pkg}.py"), *site.glob(f"{pkg}-*.dist-info")]:
                tar.add(path, f"usr/local/lib/{version}/site-packages/{path.name}",
                        filter=lambda i: None if i.name.endswith(".pyc") or "__pycache__" in i.name else i)
        for lib in libs:  # the file itself at the path the loader asks for (no links to resolve)
            tar.add(os.path.realpath(lib), str(lib).lstrip("/"))
        tar.add(sh, "bin/sh")
        passwd = b"root:x:0:0:root:/root:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size = len(passwd)
        tar.addfile(info, io.BytesIO(passwd))
    return out


@pytest.fixture(scope="session")
def base_image(docker_env, tmp_path_factory):
    """The minimal base, imported into the daemon (tag sim2edge-test-base:py)."""
    client, _ = docker_env
    tar = minimal_rootfs_tar(tmp_path_factory.mktemp("rootfs") / "rootfs.tar")
    client.api.import_image_from_file(str(tar), repository="sim2edge-test-base", tag="py",
                                      changes=["ENV PATH=/usr/local/bin:/usr/bin:/bin LD_LIBRARY_PATH=/usr/local/lib"])
    print(f"base rootfs tarball: {tar.stat().st_size / 1e6:.0f} MB")
    return "sim2edge-test-base:py"


def worker_context(out: Path) -> Path:
    """The worker image's context: the paths docker/worker.Dockerfile copies (not the repo's .venv)."""
    out.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copyfile(REPO / name, out / name)
    for name in ("stages", "flows", "registry", "edge"):
        shutil.copytree(REPO / name, out / name, ignore=ignore)
    shutil.copyfile(REPO / "docker" / "worker.Dockerfile", out / "Dockerfile")
    return out


def test_worker_image_builds_runs_help_and_pushes(docker_env, base_image, tmp_path):
    from stages.image import build_and_push

    client, registry = docker_env
    tag = f"{registry}/sim2edge-worker:test"
    start = time.perf_counter()
    built = build_and_push(client, worker_context(tmp_path / "ctx"), tag,
                           {"BASE": base_image, "APT_PACKAGES": "", "PIP_ARGS": "--no-deps --no-build-isolation"},
                           push=True)
    build_s = time.perf_counter() - start
    out = client.containers.run(tag, remove=True).decode()  # ENTRYPOINT sim2edge, CMD --help
    assert "import" in out and "package" in out and "targets" in out, out
    assert built.pushed and built.pushed.startswith(f"{registry}/sim2edge-worker@sha256:")
    client.images.remove(tag, force=True)
    client.images.pull(f"{registry}/sim2edge-worker", tag="test")  # back from the registry
    again = client.containers.run(tag, ["targets", "--json"], remove=True).decode()
    assert '"orin-jp6.1"' in again
    print(f"worker image: build + push {build_s:.1f} s")
