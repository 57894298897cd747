"""``sim2edge keys``, ``package``, ``import`` and ``dataset``: signing keys, Jetson images, policies trained
elsewhere and dataset versions in other formats."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from flows.cli_output import console, fail
from flows.workspace import Workspace


keys_app = typer.Typer(no_args_is_help=True, help="Ed25519 signing keys: generate a pair, print the public key.")
dataset_app = typer.Typer(no_args_is_help=True, help="Dataset versions in other formats (LeRobot v3).")


@dataset_app.command("export")
def dataset_export(
    task: str = typer.Option("cartpole", help="Registered task or module:Class."),
    version: Optional[str] = typer.Option(None, help="Dataset version (v0003; default: the latest)."),
    out: Path = typer.Option(..., help="New folder for the LeRobot v3.0 dataset."),
) -> None:
    """Write a dataset version as a LeRobot v3.0 dataset (observation.state, action, observation.qpos/qvel)."""
    from flows.cli_output import check_task
    from flows.steps import dataset_store
    from stages.collect.lerobot_logs import to_lerobot

    check_task(task)
    store = dataset_store(Workspace.from_env(), task)
    try:
        dataset = store.version(version) if version else store.latest()
        if dataset is None:
            raise KeyError(f"no dataset for task {task!r} yet: run `sim2edge collect --task {task}` first")
        data = to_lerobot(dataset, store.task, out)
    except (KeyError, ValueError, FileExistsError) as e:
        fail(str(e.args[0]) if isinstance(e, KeyError) else str(e), 1)
    console.print(f"{task} v{dataset.version:04d}: {len(set(data.episode_index.tolist()))} episodes, "
                  f"{len(data.episode_index)} frames at {data.fps:g} fps -> {out}", soft_wrap=True)


@keys_app.command("generate")
def keys_generate(out: Path = typer.Option(..., help="Folder for signing.key (0600) and signing.pub.")) -> None:
    """Write a new signing pair; refuses to overwrite an existing key."""
    from edge import signing

    if (out / "signing.key").exists():
        fail(f"{out / 'signing.key'} exists; move it away first (keys are never overwritten)")
    signing.generate_keypair(out / "signing.key", out / "signing.pub")
    console.print(f"wrote {out / 'signing.key'} (private, 0600) and {out / 'signing.pub'} (give this to devices: "
                  f"sim2edge-agent pull … --trust signing.pub)", soft_wrap=True, markup=False, highlight=False)


@keys_app.command("public")
def keys_public(key: Optional[Path] = typer.Option(None, help="Private key file (default: $SIM2EDGE_SIGNING_KEY, "
                                                             "else the workspace's).")) -> None:
    """Print the public key (PEM) that devices pin with --trust."""
    from edge import signing

    try:
        private = signing.load_private(key) if key else signing.signing_key(Workspace.from_env().keys_dir / "signing.key")
    except (OSError, ValueError) as e:
        fail(str(e))
    sys.stdout.write(signing.public_pem(private).decode())



def package_image(
    bundle: Path = typer.Argument(..., help="A signed bundle (from `sim2edge run` or `sim2edge import`)."),
    trust: Optional[Path] = typer.Option(None, help="Public key to verify it (default: the workspace's)."),
    context: Optional[Path] = typer.Option(None, help="Where to write the build context (default: BUNDLE-image/)."),
    image: bool = typer.Option(False, "--image", help="Build the Jetson image with the Docker daemon."),
    base: Optional[str] = typer.Option(None, help="Base image (default: the target's l4t-jetpack tag)."),
    registry: Optional[str] = typer.Option(None, help="Push to this registry (host:port) after building."),
) -> None:
    """Write the Jetson image's build context for a bundle; --image builds it (and --registry pushes)."""
    from stages.image import ImageConfig, build_and_push, docker_client, jetson_context

    trust = trust or Workspace.from_env().keys_dir / "signing.pub"
    out = context or bundle.with_name(bundle.stem + "-image")
    try:
        ctx = jetson_context(ImageConfig(base=base, registry=registry), bundle, trust, out)
    except Exception as e:  # the agent's refusal names the failed check
        fail(f"{bundle}: {e}")
    console.print(f"build context for {ctx.target}: {ctx.path}", soft_wrap=True, markup=False, highlight=False)
    client = docker_client() if image else None
    if client is None:
        if image:
            console.print("no Docker daemon reachable (DOCKER_HOST); build it with:", markup=False)
        console.print(ctx.command, soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(1 if image else 0)
    try:
        built = build_and_push(client, ctx.path, ctx.tag, ctx.build_args, ctx.platform, push=registry is not None)
    except RuntimeError as e:
        fail(str(e))
    console.print(f"built {built.tag} ({built.image_id})" + (f", pushed {built.pushed}" if built.pushed else ""),
                  soft_wrap=True, markup=False, highlight=False)


def import_policy(
    source: Path = typer.Argument(..., help="rsl_rl checkpoint (model_*.pt) or policy.onnx (Isaac Lab export)."),
    spec: Path = typer.Option(..., help="I/O spec (YAML or JSON): observations, actions, control period."),
    target: str = typer.Option("orin-jp6.1", help="Jetson target profile."),
    name: str = typer.Option("imported", help="Policy name in the manifest."),
    version: str = typer.Option("1", help="Policy version in the manifest."),
    out: Path = typer.Option(Path("imported"), help="Folder for onnx/ and bundle.tar."),
) -> None:
    """Import an external policy: parity-checked ONNX, op check for the target, signed bundle."""
    from edge.bundle import sha256_path
    from stages.export import ExportConfig, ParityError
    from stages.import_policy import import_checkpoint, import_onnx
    from stages.io_spec import IOSpec
    from stages.package import PackageConfig, build_manifest, package

    ws = Workspace.from_env()
    try:
        io_spec, cfg = IOSpec.from_file(spec), PackageConfig(target=target)
        reader = import_onnx if source.suffix == ".onnx" else import_checkpoint
        exported = reader(ExportConfig(), source, spec, out / "onnx")
        provenance = {"imported_from": source.name, "source_sha256": sha256_path(source), "spec_sha256": sha256_path(spec)}
        manifest = build_manifest(cfg, name, version, exported, io_spec, provenance, None)
        art = package(cfg, manifest, exported, ws.keys_dir, out / "bundle.tar")
    except (OSError, KeyError, ValueError, ParityError) as e:
        fail(str(e).strip('"'))
    console.print(f"parity max error {exported.parity_max_abs_error:.2g}; bundle {art.path} sha256 {art.digest}",
                  soft_wrap=True, markup=False, highlight=False)
    if io_spec.task != "external":
        console.print(f"evaluate it in the twin: sim2edge evaluate --bundle {art.path}", soft_wrap=True, markup=False)
