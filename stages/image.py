"""Container images: the Jetson runtime image's build context for a bundle, built with the Docker SDK.

:func:`jetson_context` verifies the bundle and writes a self-contained context (``docker/jetson.Dockerfile``,
the agent package ``edge/``, the bundle, the public key, the installer) with build arguments chosen by the
bundle's target. :func:`build_and_push` builds it with the ``docker`` package when a daemon answers and
pushes to a registry; without a daemon the context and the exact ``docker build`` command are the result.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from edge import bundle, signing
from edge.targets import load_target
from stages.artifacts import atomic_dir

REPO = Path(__file__).resolve().parent.parent
EDGE_FILES = ("*.py", "pyproject.toml")


class ImageConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    base: str | None = Field(None, description="Base image (default: the target's first, an l4t-jetpack tag).")
    l4t_version: str | None = Field(None, description="L4T_VERSION inside the image (default: the target's minimum).")
    repository: str = Field("sim2edge-policy", description="Image name without registry and tag.")
    registry: str | None = Field(None, description="host:port to push to (e.g. 127.0.0.1:5000); none: no push.")
    platform: str = "linux/arm64"


class JetsonContext(BaseModel):
    """A written build context and how to build it."""

    model_config = ConfigDict(frozen=True)
    path: Path
    target: str
    tag: str
    build_args: dict[str, str]
    platform: str

    @property
    def command(self) -> str:
        """The exact classic-builder command line."""
        args = " ".join(f"--build-arg {shlex.quote(f'{k}={v}')}" for k, v in sorted(self.build_args.items()))
        return (f"DOCKER_BUILDKIT=0 docker build --platform {self.platform} {args} -t {shlex.quote(self.tag)} "
                f"{shlex.quote(str(self.path))}")


class BuiltImage(BaseModel):
    model_config = ConfigDict(frozen=True)
    tag: str
    image_id: str
    pushed: str | None
    """The pushed reference with its digest (``host:port/name@sha256:…``), or None."""


def jetson_context(cfg: ImageConfig, bundle_file: Path, trust: Path, out: Path) -> JetsonContext:
    """Verify ``bundle_file`` against ``trust`` and write the Jetson image's build context to ``out`` (atomically)."""
    with tempfile.TemporaryDirectory() as tmp:
        manifest = bundle.extract(bundle_file, Path(tmp), max_bytes=1 << 31, trusted=signing.load_trusted([trust]))
    target = load_target(manifest["target"]["name"])
    base = cfg.base or (target.base_images[0] if target.base_images else None)
    if base is None:
        raise ValueError(f"target {target.name} has no base image; pass one (ImageConfig.base / --base)")
    policy = manifest["policy"]
    tag = f"{cfg.registry + '/' if cfg.registry else ''}{cfg.repository}:{policy['name']}-{policy['version']}-{target.name}"
    build_args = {"BASE": base, "L4T_VERSION": cfg.l4t_version or ".".join(map(str, target.l4t_min)),
                  "ORT_INDEX": target.onnxruntime_index}
    with atomic_dir(out) as ctx:
        shutil.copyfile(REPO / "docker" / "jetson.Dockerfile", ctx / "Dockerfile")
        shutil.copyfile(REPO / "docker" / "install_bundle.py", ctx / "install_bundle.py")
        shutil.copyfile(bundle_file, ctx / "bundle.tar")
        shutil.copyfile(trust, ctx / "trust.pub")
        (ctx / "edge").mkdir()
        for pattern in EDGE_FILES:
            for f in sorted((REPO / "edge").glob(pattern)):
                shutil.copyfile(f, ctx / "edge" / f.name)
        (ctx / ".dockerignore").write_text("**/__pycache__\n")
    return JetsonContext(path=out, target=target.name, tag=tag, build_args=build_args, platform=cfg.platform)


def docker_client(timeout_s: float = 5.0):
    """A Docker SDK client whose daemon answers a ping (``DOCKER_HOST`` etc. as the docker CLI reads them), or None."""
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=timeout_s)
        client.ping()
        return client
    except DockerException:
        return None


def build_and_push(client, path: Path, tag: str, build_args: dict[str, str], platform: str | None = None,
                   dockerfile: str = "Dockerfile", push: bool = False) -> BuiltImage:
    """Build ``path`` with the daemon's classic builder; push ``tag`` when asked. Errors carry the build log tail."""
    from docker.errors import BuildError

    try:
        image, _ = client.images.build(path=str(path), dockerfile=dockerfile, tag=tag, buildargs=build_args,
                                       platform=platform, rm=True, forcerm=True, pull=False)
    except BuildError as e:
        tail = "".join(chunk.get("stream", "") or chunk.get("error", "") for chunk in e.build_log)[-3000:]
        raise RuntimeError(f"docker build of {path} failed: {e.msg}\n{tail}") from None
    pushed = None
    if push:
        repository, _, version = tag.rpartition(":")
        digest = None
        for event in client.images.push(repository, tag=version, stream=True, decode=True):
            if "error" in event:
                raise RuntimeError(f"docker push {tag} failed: {event['error']}")
            digest = event.get("aux", {}).get("Digest", digest)
        pushed = f"{repository}@{digest}" if digest else tag
    return BuiltImage(tag=tag, image_id=image.id, pushed=pushed)
