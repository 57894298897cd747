"""Pull: resolve → download → unpack → verify → target check → smoke test → install → activate → health.

Every step before the switch works in a staging directory of the store; any failure
removes it and leaves ``current`` as it was. A failed health check after the switch
switches back. The store's lock is held throughout, so two agents never interleave.

Registry unavailable (unreachable, or 5xx after every retry): ``current`` is untouched, the
error says so, and the failure is counted in ``<root>/backoff.json``: the next pull before
its ``next_attempt`` time is refused (check ``backoff``) without touching the network.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from edge import bundle, crash
from edge.errors import CheckFailed
from edge.registry_client import (BundleRef, DownloadStats, RegistryClient, RegistryUnavailable, TransferOptions,
                                  parse_ref)
from edge.store import DeviceStore
from edge.targets import check_compatible, detect_device, load_target

if TYPE_CHECKING:  # numpy, ONNX Runtime and the smoke test load only when a bundle is installed
    from edge.smoke import SmokeResult


@dataclass(frozen=True)
class PullOptions:
    """How hard to try: per-request retries (``transfer``) and the backoff between pulls."""

    transfer: TransferOptions = field(default_factory=TransferOptions)
    backoff_base_s: float = 30.0   # after n failed pulls the next waits ~base·2^(n-1) …
    backoff_cap_s: float = 1800.0  # … at most this long
    ignore_backoff: bool = False


@dataclass(frozen=True)
class PullResult:
    policy: str
    version: str
    path: Path
    changed: bool
    smoke: Optional["SmokeResult"]
    download: Optional[DownloadStats] = None


def check_fresh(active: Optional[dict], policy: str, version: str) -> None:
    """Refuse a version older than the active one (rollback attacks); rollback is its own command."""
    if active and active["policy"]["name"] == policy and int(version) < int(active["policy"]["version"]):
        raise CheckFailed("freshness", f"{policy} v{version} is older than the active v{active['policy']['version']}; "
                                       f"use `sim2edge-agent rollback` to go back on purpose")


def health_check(store: DeviceStore, expected: Path, manifest: dict) -> str:
    """After the switch: ``current`` resolves to ``expected`` and serves the golden outputs through it.

    Returns the runtime that served them (``onnxruntime (CPUExecutionProvider)``)."""
    import numpy as np

    from edge.runtime import OnnxRuntime

    current = store.link("current")
    if current != expected:
        raise CheckFailed("health", f"current points at {current}, expected {expected}")
    if json.loads((current / bundle.MANIFEST).read_text())["policy"] != manifest["policy"]:
        raise CheckFailed("health", f"{current / bundle.MANIFEST} is not the manifest that was installed")
    golden = np.load(current / "golden.npz")
    runtime = OnnxRuntime(current / "policy.onnx", manifest["runtime"]["onnxruntime_providers"])
    out = runtime.run(golden["inputs"][:1].astype(np.float32))
    tol = manifest["parity_tolerance"]["fp32"]
    err = float(np.max(np.abs(out - golden["outputs"][:1])))
    if not err <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(golden["outputs"]))):  # the smoke test's rule
        raise CheckFailed("health", f"{current}/policy.onnx no longer reproduces its golden output")
    return f"{runtime.name} ({', '.join(runtime.providers)})"


def activate_checked(store: DeviceStore, final: Path, manifest: dict, remove_on_failure: bool) -> str:
    """Switch ``current`` to ``final`` and health-check it there; on any failure switch both links back
    (journaled as ``health-rollback``; ``final`` removed if asked and not ``previous``). Returns the runtime."""
    old, old_previous = store.link("current"), store.link("previous")
    store.activate(final)
    crash.corrupt("switched", final)
    try:
        return health_check(store, final, manifest)
    except Exception as e:  # anything (ONNX Runtime raises its own exception types): switch back
        store.restore(old, old_previous)
        if remove_on_failure and final != old_previous:
            store.remove(final)  # failed after install: not trusted, a later pull downloads it again
        detail = str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
        policy, version = manifest["policy"]["name"], str(manifest["policy"]["version"])
        store.record("health-rollback", policy=policy, version=version, detail=detail,
                     restored=str(old) if old else None)
        raise CheckFailed("health", f"{policy} v{version} failed its health check after activation ({detail}); "
                                    f"current restored to {old or 'none'}") from None


def rollback(root: Path, trusted: Iterable, version: Optional[str] = None) -> Path:
    """Re-verify an installed bundle (``previous`` by default) and make it current."""
    store = DeviceStore(root)
    with store.locked():
        current = store.link("current")
        if version is None:
            target = store.link("previous")
            if target is None:
                raise CheckFailed("rollback", "there is no previous policy to roll back to")
        else:
            if current is None:
                raise CheckFailed("rollback", "no active policy")
            target = store.bundle_dir(current.parent.name, version)
            if not target.is_dir():
                raise CheckFailed("rollback", f"{current.parent.name} v{version} is not installed "
                                              f"(installed: {', '.join(store.installed(current.parent.name))})")
        from edge.smoke import smoke_test

        manifest = bundle.verify_dir(target, trusted)
        smoke_test(target, manifest)
        runtime = activate_checked(store, target, manifest, remove_on_failure=False)
        store.record("rollback", policy=manifest["policy"]["name"], version=str(manifest["policy"]["version"]),
                     from_path=str(current) if current else None, runtime=runtime)
        return target


def _check_backoff(store: DeviceStore, registry_url: str) -> None:
    state = store.backoff_state()
    if state and state.get("failures") and state.get("registry") == registry_url and time.time() < state["next_attempt"]:
        wait = state["next_attempt"] - time.time()
        raise CheckFailed("backoff", f"registry {registry_url} was unavailable on the last {state['failures']} "
                                     f"attempt(s) ({state['last_error']}); backing off, next attempt in {wait:.0f} s "
                                     f"(current policy unchanged; --ignore-backoff to try now)")


def pull(ref: str, registry_url: str, root: Path, trusted: Iterable, skip_target_check: bool = False,
         options: Optional[PullOptions] = None) -> PullResult:
    """Pull ``policy@alias|version`` into the store at ``root`` and activate it."""
    options = options or PullOptions()
    store = DeviceStore(root)
    with store.locked():
        if not options.ignore_backoff:
            _check_backoff(store, registry_url)
        client = RegistryClient(registry_url, options.transfer)
        try:
            try:
                target_ref = client.resolve(ref)
                result = _pull_locked(store, client, ref, target_ref, registry_url, trusted, skip_target_check)
            except RegistryUnavailable as e:
                state = store.note_unavailable(registry_url, e.detail, options.backoff_base_s, options.backoff_cap_s)
                current = store.link("current")
                store.record("unavailable", ref=ref, detail=e.detail, failures=state["failures"],
                             retry_after_s=round(state["next_attempt"] - time.time(), 1))
                raise RegistryUnavailable(f"{e.detail}; current policy unchanged "
                                          f"({current if current else 'none active'}); next attempt in "
                                          f"{state['next_attempt'] - time.time():.1f} s") from None
        except CheckFailed as e:
            if e.check not in ("backoff", "health") and not isinstance(e, RegistryUnavailable):  # health: journaled
                store.record("refused", ref=ref, check=e.check, detail=e.detail)
            raise
        store.clear_backoff()
        return result


def _pull_locked(store: DeviceStore, client: RegistryClient, ref: str, target_ref: BundleRef, registry_url: str,
                 trusted: Iterable, skip_target_check: bool) -> PullResult:
    installed = store.bundle_dir(target_ref.policy, target_ref.version)
    part = store.download_part(target_ref.sha256)
    if store.link("current") == installed:
        if part.exists():
            part.unlink()  # a crash after activation left it
        return PullResult(target_ref.policy, target_ref.version, installed, False, None)
    check_fresh(store.current_manifest(), target_ref.policy, target_ref.version)
    staging = store.staging_dir()
    stats = None
    try:
        if installed.is_dir():
            # installed by an earlier pull that died before activating: verify it again, no download
            candidate = installed
        else:
            stats = client.download(target_ref, part, on_chunk=lambda n: crash.point("download"))
            crash.point("downloaded")
            candidate = staging / "bundle"
            candidate.mkdir()
            try:
                bundle.extract(part, candidate, max_bytes=4 * target_ref.size + (1 << 20))
            except CheckFailed:
                part.unlink()
                raise
        manifest = bundle.verify_dir(candidate, trusted)
        if (manifest["policy"]["name"], str(manifest["policy"]["version"])) != (target_ref.policy, target_ref.version):
            raise CheckFailed("manifest", f"bundle is {manifest['policy']['name']} v{manifest['policy']['version']}, "
                                          f"registry said {target_ref.policy} v{target_ref.version}")
        crash.point("verified")
        from edge.smoke import smoke_test

        if not skip_target_check:
            check_compatible(load_target(manifest["target"]["name"]), detect_device())
        smoke = smoke_test(candidate, manifest)
        crash.point("smoked")
        final = installed if candidate == installed else store.install(candidate, target_ref.policy, target_ref.version)
        runtime = activate_checked(store, final, manifest, remove_on_failure=True)
        crash.point("activated")
        store.record("activate", policy=target_ref.policy, version=target_ref.version, source=registry_url,
                     run_id=target_ref.run_id, bundle_sha256=target_ref.sha256, smoke_p99_s=smoke.latency_p99_s,
                     runtime=runtime,
                     target_check=not skip_target_check,
                     download_attempts=stats.attempts if stats else 0,
                     resumed_from=stats.resumed_from if stats else 0)
        crash.point("journaled")
        if part.exists():
            part.unlink()
        return PullResult(target_ref.policy, target_ref.version, final, True, smoke, stats)
    finally:
        shutil.rmtree(str(staging), ignore_errors=True)


def watch(ref: str, registry_url: str, root: Path, trusted: Iterable, interval_s: float = 60.0, jitter: float = 0.2,
          skip_target_check: bool = False, options: Optional[PullOptions] = None, iterations: Optional[int] = None,
          rng: Optional[random.Random] = None, device_id: Optional[str] = None) -> None:
    """Poll ``ref`` every ``interval_s`` (× uniform(1-jitter, 1+jitter), so a fleet spreads out) and pull new
    versions with all of pull's checks. Refusals and outages are reported on stderr and the loop goes on;
    the persisted backoff keeps an unavailable registry from being hammered. With ``device_id``, each poll
    ends with a state report to the registry (edge/report.py), which never stops the loop."""
    from edge.report import Reporter

    rng = rng or random.Random()
    trusted = list(trusted)
    options = options or PullOptions()
    reporter = None
    if device_id:
        reporter = Reporter(root, registry_url, parse_ref(ref)[0], device_id, trusted,
                            timeout_s=min(5.0, options.transfer.timeout_s), backoff_base_s=options.backoff_base_s)
    polls = 0
    while True:
        try:
            result = pull(ref, registry_url, root, trusted, skip_target_check, options)
            if result.changed:
                print(f"watch: activated {result.policy} v{result.version} at {result.path}", flush=True)
        except CheckFailed as e:
            print(f"watch: {e}", file=sys.stderr, flush=True)
        if reporter is not None:
            reporter.report()
        polls += 1
        if iterations is not None and polls >= iterations:
            return
        time.sleep(interval_s * rng.uniform(1 - jitter, 1 + jitter))
