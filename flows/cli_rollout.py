"""``sim2edge rollout start|status|pause|resume|abort``: staged rollouts through a TUF repository (flows/rollout.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import typer

from flows.cli_output import console, fail, listing, print_json, print_listing
from flows.workspace import Workspace

rollout_app = typer.Typer(no_args_is_help=True, help="Roll a version out ring by ring; halt and roll back on failures.")


def _state_dir(ws: Workspace) -> Path:
    return ws.home / "rollouts"


def _rings(value: str):
    """``canary:5%,early:25%,all`` or a ring spec YAML file (registry/rings.py)."""
    from registry.rings import RingSpec

    if Path(value).is_file():
        return RingSpec.load(value)
    rings = []
    for part in value.split(","):
        name, _, share = part.strip().partition(":")
        if share and not share.endswith("%"):
            raise ValueError(f"--rings {part!r}: expected NAME or NAME:PERCENT% (or a ring spec YAML file)")
        rings.append({"name": name, **({"percent": float(share[:-1])} if share else {})})
    return RingSpec.model_validate({"rings": rings})


@rollout_app.command("start")
def start(
    ref: str = typer.Argument(..., help="<policy>@<version> or <policy>@<alias> of a registered policy."),
    repo: Path = typer.Option(..., help="TUF repository the devices poll (`sim2edge-agent watch --tuf`)."),
    mqtt: str = typer.Option(..., help="The broker the devices report to (mqtt://HOST:PORT)."),
    rings: str = typer.Option("canary:5%,early:25%,all", help="Rings in order, cumulative percentages, "
                                                               "or a ring spec YAML file."),
    keys: Optional[Path] = typer.Option(None, help="TUF role keys (default: <workspace>/tuf-keys)."),
    fleet: str = typer.Option("default", help="The fleet (topics sim2edge/<fleet>/+/state)."),
    previous: Optional[str] = typer.Option(None, help="The version failing rings go back to (default: the highest "
                                                      "published before it)."),
    abort_failed: float = typer.Option(5.0, help="Halt a ring when more than this % of its executed devices fail."),
    min_devices: int = typer.Option(1, help="Devices of a ring that must have executed before it is judged."),
    soak: float = typer.Option(60.0, help="Seconds a ring whose devices all succeeded is watched before the next."),
    ring_timeout: float = typer.Option(900.0, help="Seconds after which a device not on the version timed out."),
    rate_base: Optional[int] = typer.Option(None, help="Rollout rate: devices of a ring admitted in its first minute "
                                                       "(1-1000; default: a whole ring at once)."),
    rate_factor: Optional[float] = typer.Option(None, help="Each minute admits this many times the last (1-5; "
                                                           "default 1); needs --rate-base."),
    poll: float = typer.Option(30.0, help="Seconds between looks at the fleet."),
    max_polls: Optional[int] = typer.Option(None, help="Return after this many polls (the rollout stays saved)."),
    mqtt_user: str = typer.Option("sim2edge-reader"),
    mqtt_password_file: Optional[Path] = typer.Option(None, help="Default: $SIM2EDGE_MQTT_PASSWORD."),
) -> None:
    """Publish the version (without moving latest.tar) and run the `rollout` flow until it ends; run again to
    resume a rollout whose process died."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from pydantic import ValidationError

    from flows.rollout import RolloutParams, load_state, rollout
    from registry.models import registered_bundle
    from registry.rollout import RolloutConfig, start as begin, plan
    from registry.tuf_repo import PublishConfig, RepoConfig, publish, published_versions, write_rollout

    policy, sep, which = ref.partition("@")
    if not sep or not policy or not which:
        fail(f"{ref!r} must look like <policy>@<alias> or <policy>@<version>")
    if rate_base is not None and not 1 <= rate_base <= 1000:
        fail(f"--rate-base {rate_base}: devices per minute, 1-1000")
    if rate_factor is not None and (rate_base is None or not 1 <= rate_factor <= 5):
        fail(f"--rate-factor {rate_factor:g}: " + ("needs --rate-base" if rate_base is None else "a factor in 1-5"))
    ws = Workspace.from_env()
    keys = keys or ws.home / "tuf-keys"
    try:
        spec = _rings(rings)
        with tempfile.TemporaryDirectory() as tmp:
            version, tar = registered_bundle(MlflowClient(ws.tracking_uri()), policy, which, Path(tmp))
            published = published_versions(repo, policy)
            before = sorted(int(v) for v in published if int(v) < int(version))
            cfg = RolloutConfig(policy=policy, version=version, previous=previous or (str(before[-1]) if before else None),
                                rings=spec, abort_failed_percent=abort_failed, min_devices=min_devices, soak_s=soak,
                                ring_timeout_s=ring_timeout, rate_base_per_min=rate_base,
                                rate_increment_factor=rate_factor)
            if version not in published:
                held = begin(cfg, 0.0).model_copy(update={"status": "aborted"})  # everyone at the previous version
                if cfg.previous:
                    write_rollout(RepoConfig(repo=repo, keys=keys), policy, plan(held))
                publish(PublishConfig(repo=repo, keys=keys, bundle=tar, policy=policy, version=version,
                                      move_latest=False))
        params = RolloutParams(config=cfg, repo=repo, key_dir=keys, broker=mqtt, fleet=fleet, mqtt_user=mqtt_user,
                               mqtt_password_file=mqtt_password_file, state_dir=_state_dir(ws), poll_s=poll,
                               max_polls=max_polls)
    except ValidationError as e:
        err = e.errors()[0]
        fail(f"rollout: {'.'.join(map(str, err['loc']))}: {err['msg']}")
    except (MlflowException, OSError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    old = load_state(params.state_dir, policy)
    if old is not None and not old.ended:
        if old.config.version != version:
            fail(f"a rollout of {policy} v{old.config.version} is {old.status}: abort it first")
        params = params.model_copy(update={"config": old.config})  # resumed as it was started
    state = rollout(params)
    console.print(f"rollout {policy} v{version}: {state.status} {state.reason}".rstrip(), soft_wrap=True,
                  markup=False, highlight=False)
    if state.status in ("halted", "aborted"):
        raise typer.Exit(1)


@rollout_app.command("status")
def status(policy: str = typer.Argument(..., help="The policy being rolled out."),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """The rollout's rings as last judged."""
    from flows.rollout import load_state

    state = load_state(_state_dir(Workspace.from_env()), policy)
    if state is None:
        fail(f"no rollout of {policy} (start one with `sim2edge rollout start`)")
    if as_json:
        print_json(state.model_dump(mode="json"))
        return
    console.print(f"{policy} v{state.config.version} (previous v{state.config.previous or '-'}): {state.status} "
                  f"{state.reason}".rstrip(), soft_wrap=True, markup=False, highlight=False)
    print_listing(listing(["ring", "status", "admitted %", "devices", "succeeded", "failed", "timed out",
                           "failed devices"],
                          [[r.name, r.status, f"{r.admitted:.3g}", str(r.devices), str(r.succeeded), str(r.failed),
                            str(r.timed_out), ", ".join(r.failed_devices)] for r in state.rings]))


def _command(policy: str, command: str) -> None:
    from flows.rollout import control_file, load_state

    ws = Workspace.from_env()
    state = load_state(_state_dir(ws), policy)
    if state is None or state.ended:
        fail(f"no running rollout of {policy}" + (f" (it {state.status})" if state else ""))
    control_file(_state_dir(ws), policy).write_text(command + "\n")
    console.print(f"rollout {policy}: {command} asked; the flow applies it at its next poll", markup=False)


@rollout_app.command("pause")
def pause(policy: str = typer.Argument(...)) -> None:
    """Stop judging and advancing; devices keep what they run."""
    _command(policy, "pause")


@rollout_app.command("resume")
def resume(policy: str = typer.Argument(...)) -> None:
    """Judge and advance again."""
    _command(policy, "resume")


@rollout_app.command("abort")
def abort(policy: str = typer.Argument(...)) -> None:
    """End the rollout and send every ring back to the previous version."""
    _command(policy, "abort")
