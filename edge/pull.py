"""Pull: resolve → download → unpack → verify → target check → smoke test → install → activate → health.

Resolve and download go through a :class:`BundleSource`: the MLflow registry (edge/registry_client.py) or a TUF
repository (edge/tuf_client.py); both yield the same parsed :class:`BundleRef`, and everything after is shared.

Every step before the switch works in a staging directory of the store; any failure
removes it and leaves ``current`` as it was. A failed health check after the switch
switches back. The store's lock is held throughout, so two agents never interleave.

Registry unavailable (unreachable, or 5xx after every retry): ``current`` is untouched, the
error says so, and the failure is counted in ``<root>/backoff.json``: the next pull before
its ``next_attempt`` time is refused (check ``backoff``) without touching the network.

A version whose bundle fails a check once it is on the device (verification, target, smoke test,
health check, a failed gate) is remembered by digest in ``<root>/failed.json`` and refused (check
``known-bad``) without a download until the registry's digest for it changes or ``retry_failed`` is
set; a signature failure is remembered with the trusted-key set it failed against, so a pull with
other ``--trust`` keys tries again. A stored, not active copy that no longer verifies is removed and
downloaded again; a damaged ``current`` is never removed by a pull (check ``corrupt``).

A bundle whose signed manifest records a failed evaluation gate (a ``challenger``) is refused
(check ``gate``) unless ``allow_failed_gate`` is set.

Every refusal is journaled (``refused``, with its check) and leaves no download or staging behind;
only a transfer cut short (unavailable, deadline) keeps its ``.part`` for the next pull to resume.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Optional, Protocol

from edge import bundle, crash
from edge.errors import CheckFailed, RegistryUnavailable, is_disk_full
from edge.fetched import check_identity, unpack
from edge.registry_answers import BundleRef, parse_ref
from edge.registry_client import DownloadStats, RegistryClient, TransferOptions
from edge.signing import key_ids
from edge.store import DeviceStore
from edge.targets import check_compatible, detect_device, load_target
from edge.values import Version

if TYPE_CHECKING:  # numpy, ONNX Runtime and the smoke test load only when a bundle is installed
    from edge.smoke import SmokeResult


@dataclass(frozen=True)
class PullOptions:
    """How hard to try: per-request retries (``transfer``) and the backoff between pulls."""

    transfer: TransferOptions = field(default_factory=TransferOptions)
    backoff_base_s: float = 30.0   # after n failed pulls the next waits ~base·2^(n-1) …
    backoff_cap_s: float = 1800.0  # … at most this long
    ignore_backoff: bool = False
    retry_failed: bool = False     # try a version again although its bundle (same digest) failed before
    allow_failed_gate: bool = False  # install a bundle whose signed manifest records a failed evaluation gate
    min_free_bytes: Optional[int] = None  # refuse before downloading unless the bundle, unpacked, leaves this free


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

    from edge.runtime import select_runtime
    from edge.smoke import tolerance

    current = store.link("current")
    if current != expected:
        raise CheckFailed("health", f"current points at {current}, expected {expected}")
    if json.loads((current / bundle.MANIFEST).read_text())["policy"] != manifest["policy"]:
        raise CheckFailed("health", f"{current / bundle.MANIFEST} is not the manifest that was installed")
    golden = np.load(current / "golden.npz")
    selection = select_runtime(current / "policy.onnx", manifest, store.engines_dir)  # the engine the smoke test built
    out = selection.runtime.run(golden["inputs"][:1].astype(np.float32))
    tol = tolerance(selection.runtime, manifest)
    err = float(np.max(np.abs(out - golden["outputs"][:1])))
    if not err <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(golden["outputs"]))):  # the smoke test's rule
        raise CheckFailed("health", f"{current}/policy.onnx no longer reproduces its golden output")
    return f"{selection.runtime.name} ({', '.join(selection.runtime.providers)})"


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
            version = Version.parse(version, "--to", "rollback")
            target = store.bundle_dir(current.parent.name, version)
            if not target.is_dir():
                raise CheckFailed("rollback", f"{current.parent.name} v{version} is not installed "
                                              f"(installed: {', '.join(store.installed(current.parent.name))})")
        from edge.smoke import smoke_test

        manifest = bundle.verify_dir(target, trusted)
        smoke_test(target, manifest, engines_dir=store.engines_dir)
        runtime = activate_checked(store, target, manifest, remove_on_failure=False)
        store.record("rollback", policy=manifest["policy"]["name"], version=str(manifest["policy"]["version"]),
                     from_path=str(current) if current else None, runtime=runtime)
        return target


def _check_backoff(store: DeviceStore, registry_url: str, cap_s: float) -> None:
    backing_off = store.backoff_left(registry_url, cap_s)
    if backing_off:
        wait, state = backing_off
        raise CheckFailed("backoff", f"registry {registry_url} was unavailable on the last {state['failures']} "
                                     f"attempt(s) ({state['last_error']}); backing off, next attempt in {wait:.0f} s "
                                     f"(current policy unchanged; --ignore-backoff to try now)")


class BundleSource(Protocol):
    """Where bundles come from: the MLflow registry (edge/registry_client.py) or a TUF repository (edge/tuf_client.py)."""

    def resolve(self, ref: str) -> BundleRef: ...

    def download(self, ref: BundleRef, part: Path, on_chunk: Optional[Callable[[int], None]] = None) -> DownloadStats: ...


def pull(ref: str, registry_url: str, root: Path, trusted: Iterable, skip_target_check: bool = False,
         options: Optional[PullOptions] = None,
         source: Optional[Callable[[DeviceStore], BundleSource]] = None) -> PullResult:
    """Pull ``policy@alias|version`` into the store at ``root`` and activate it. ``source(store)`` makes the client
    that resolves and downloads (default: the MLflow registry at ``registry_url``; a TUF client names its URL there)."""
    options = options or PullOptions()
    store = DeviceStore(root)
    with store.locked():
        if not options.ignore_backoff:
            _check_backoff(store, registry_url, options.backoff_cap_s)
        client = source(store) if source else RegistryClient(registry_url, options.transfer)
        try:
            try:
                target_ref = client.resolve(ref)
                result = _pull_locked(store, client, target_ref, registry_url, list(trusted), skip_target_check,
                                      options)
            except RegistryUnavailable as e:
                state = store.note_unavailable(registry_url, e.detail, options.backoff_base_s, options.backoff_cap_s)
                current = store.link("current")
                store.record("unavailable", ref=ref, detail=e.detail, failures=state["failures"],
                             retry_after_s=round(state["next_attempt"] - time.time(), 1))
                raise RegistryUnavailable(f"{e.detail}; current policy unchanged "
                                          f"({current if current else 'none active'}); next attempt in "
                                          f"{max(0.0, state['next_attempt'] - time.time()):.1f} s", e.check) from None
        except CheckFailed as e:
            if e.check not in ("backoff", "health", "store") and not isinstance(e, RegistryUnavailable):
                # health: journaled by activate_checked; store: by the store's lock
                _record_refusal(store, ref, e)
            raise
        store.clear_backoff()
        return result


def _record_refusal(store: DeviceStore, ref: str, e: CheckFailed) -> None:
    """Journal a refusal, unless the last event is the same refusal (a watch polling a bad version) or the
    store cannot be written (a disk still full, a link where the journal should be: the refusal is on stderr)."""
    try:
        history = store.history()
        last = history[-1] if history else {}
        if (last.get("event"), last.get("ref"), last.get("check"), last.get("detail")) != ("refused", ref, e.check,
                                                                                          e.detail):
            store.record("refused", ref=ref, check=e.check, detail=e.detail)
    except (CheckFailed, OSError):
        pass


def _check_current(current: Path, trusted: Iterable) -> None:
    """The active version is asked for again: it must still verify. Never removed here."""
    try:
        bundle.verify_dir(current, trusted)
    except (CheckFailed, OSError, ValueError) as e:
        raise CheckFailed("corrupt", f"the active {current.parent.name} v{current.name} at {current} fails "
                                     f"verification ({e}); pull never removes `current`: roll back or activate "
                                     f"another version") from None


def _check_not_known_bad(store: DeviceStore, target_ref: BundleRef, keys: list, allow_failed_gate: bool) -> None:
    bad = store.known_bad(target_ref.policy, target_ref.version, target_ref.sha256, keys)
    if bad and not (bad["check"] == "gate" and allow_failed_gate):
        raise CheckFailed("known-bad", f"{target_ref.policy} v{target_ref.version} (bundle sha256 "
                                       f"{target_ref.sha256[:12]}…) failed its {bad['check']} check "
                                       f"{bad['count']} time(s), last: {bad['detail']}; not downloaded again until "
                                       f"the registry's bundle changes (or pull --retry-failed)")


def _stored_copy(store: DeviceStore, installed: Path, trusted: Iterable) -> Optional[dict]:
    """The manifest of a copy installed by an earlier pull that died before activating, if it still verifies.

    A damaged copy is removed (journaled ``discarded``) so that it is downloaded again, unless it is ``previous``."""
    if not installed.is_dir():
        return None
    try:
        return bundle.verify_dir(installed, trusted)
    except (CheckFailed, OSError, ValueError) as e:
        if installed == store.link("previous"):
            raise CheckFailed("stored", f"the stored copy {installed} is `previous` and fails verification ({e}); "
                                        f"not removed (`sim2edge-agent repair` downloads it again)") from None
        store.remove(installed)
        store.record("discarded", policy=installed.parent.name, version=installed.name, path=str(installed),
                     detail=str(e)[:500])
        return None


def _pull_locked(store: DeviceStore, client: BundleSource, target_ref: BundleRef, registry_url: str,
                 trusted: list, skip_target_check: bool, options: PullOptions) -> PullResult:
    installed = store.bundle_dir(target_ref.policy, target_ref.version)
    part = store.download_part(target_ref.sha256)
    if store.link("current") == installed:
        _check_current(installed, trusted)
        if part.exists():
            part.unlink()  # a crash after activation left it
        return PullResult(target_ref.policy, target_ref.version, installed, False, None)
    keys = key_ids(trusted)
    staging = store.staging_dir()
    try:
        if not target_ref.directed:
            check_fresh(store.current_manifest(), target_ref.policy, target_ref.version)
        if not options.retry_failed:
            _check_not_known_bad(store, target_ref, keys, options.allow_failed_gate)
        manifest = _stored_copy(store, installed, trusted)
        if manifest is None and options.min_free_bytes is not None:
            _check_room(store, target_ref, options.min_free_bytes)
        stats = None if manifest else client.download(target_ref, part, on_chunk=lambda n: crash.point("download"))
        try:
            return _install_activate(store, target_ref, part, staging, manifest, registry_url, trusted,
                                     skip_target_check, stats, options.allow_failed_gate)
        except CheckFailed as e:
            store.note_failed(target_ref.policy, target_ref.version, target_ref.sha256, e.check, e.detail, keys)
            raise
    except CheckFailed as e:
        if not isinstance(e, RegistryUnavailable) and part.exists():
            part.unlink()  # refused: nothing kept (a transfer cut short keeps its part for a resume)
        raise
    except OSError as e:
        if not is_disk_full(e):
            raise
        refusal = store.disk_full(e, f"installing {target_ref.policy} v{target_ref.version}")
        if part.exists():
            part.unlink()
        raise refusal from None
    finally:
        store.discard(staging)


def _check_room(store: DeviceStore, ref: BundleRef, min_free: int) -> None:
    """Refuse (check ``disk``) a download that, with its unpacked copy, would leave less than ``min_free`` bytes."""
    free = store.free_bytes()
    if free - 2 * ref.size < min_free:
        raise CheckFailed("disk", f"{ref.policy} v{ref.version} needs {2 * ref.size} bytes (download and unpacked "
                                  f"copy) on {store.root}, which has {free} bytes free; --min-free {min_free}")


def check_gate(manifest: dict, allow_failed_gate: bool) -> None:
    """Refuse a bundle whose signed manifest records a failed evaluation gate, unless allowed."""
    evaluation = manifest.get("evaluation") or {}
    if evaluation.get("passed") is False and not allow_failed_gate:
        m = manifest["policy"]
        raise CheckFailed("gate", f"{m['name']} v{m['version']} failed its evaluation gate when it was packaged "
                                  f"(success rate {evaluation.get('success_rate')}, a challenger); "
                                  f"pull --allow-failed-gate installs it anyway")


def _install_activate(store: DeviceStore, target_ref: BundleRef, part: Path, staging: Path, manifest: Optional[dict],
                      registry_url: str, trusted: Iterable, skip_target_check: bool,
                      stats: Optional[DownloadStats], allow_failed_gate: bool) -> PullResult:
    """Unpack (unless ``manifest`` says the stored copy verified), verify, check, smoke-test, install, activate."""
    installed = store.bundle_dir(target_ref.policy, target_ref.version)
    if manifest is not None:
        candidate = installed
    else:
        crash.point("downloaded")
        candidate = staging / "bundle"
        manifest = unpack(part, candidate, target_ref, trusted)  # a refused download is deleted by the caller
    check_identity(manifest, target_ref)
    check_gate(manifest, allow_failed_gate)
    crash.point("verified")
    from edge.smoke import smoke_test

    if not skip_target_check:
        check_compatible(load_target(manifest["target"]["name"]), detect_device())
    smoke = smoke_test(candidate, manifest, engines_dir=store.engines_dir)
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
    store.clear_failed(target_ref.policy, target_ref.version)
    if part.exists():
        part.unlink()
    return PullResult(target_ref.policy, target_ref.version, final, True, smoke, stats)


def _repair(root: Path, registry_url: str, trusted: list, options: PullOptions) -> None:
    """Before each poll: download damaged non-active copies again (edge/repair.py), within the pull backoff."""
    from edge.repair import repair

    store = DeviceStore(root)
    if not options.ignore_backoff:
        _check_backoff(store, registry_url, options.backoff_cap_s)
    try:
        report = repair(root, registry_url, trusted, options.transfer)
    except RegistryUnavailable:
        return  # the pull that follows meets the same outage, counts it and backs off
    for damage in report.repaired:
        print(f"watch: repaired {damage.policy} v{damage.version} ({damage.detail})", flush=True)
    for failure in report.failed:
        print(f"watch: repair failed: {failure}", file=sys.stderr, flush=True)


def watch(ref: str, registry_url: str, root: Path, trusted: Iterable, interval_s: float = 60.0, jitter: float = 0.2,
          skip_target_check: bool = False, options: Optional[PullOptions] = None, iterations: Optional[int] = None,
          rng: Optional[random.Random] = None, device_id: Optional[str] = None,
          source: Optional[Callable[[DeviceStore], BundleSource]] = None, also=None,
          labels: Optional[Dict[str, str]] = None) -> None:
    """Poll ``ref`` every ``interval_s`` (× uniform(1-jitter, 1+jitter), so a fleet spreads out) and pull new
    versions with all of pull's checks. Refusals and outages are reported on stderr (the same one on
    consecutive polls once) and the loop goes on; a known-bad version is not downloaded again;
    the persisted backoff keeps an unavailable registry from being hammered. Each poll first downloads
    damaged non-active copies again (``previous`` included; edge/repair.py). With ``device_id``, each poll
    ends with a state report to the registry (edge/report.py), which never stops the loop. With ``source`` (a TUF
    repository, named by ``registry_url``) each poll pulls through it; repair and reports need MLflow and are off.
    ``labels`` (``--label``) travel in the report. ``also``: a second reporter (edge/mqtt_report.py) whose ``report()`` ends each poll, with or without MLflow."""
    from edge.report import device_reporter

    rng = rng or random.Random()
    trusted = list(trusted)
    options = options or PullOptions()
    reporter = None
    if device_id and source is None:
        reporter = device_reporter(root, registry_url, parse_ref(ref)[0], device_id, trusted,
                                   timeout_s=min(5.0, options.transfer.timeout_s), backoff_base_s=options.backoff_base_s,
                                   labels=labels)
    later = dataclasses.replace(options, retry_failed=False)  # --retry-failed: the first poll only
    polls, last_error = 0, ""
    while True:
        try:
            if source is None:
                _repair(root, registry_url, trusted, options)
            result = pull(ref, registry_url, root, trusted, skip_target_check, later if polls else options, source)
            last_error = ""
            if result.changed:
                print(f"watch: activated {result.policy} v{result.version} at {result.path}", flush=True)
        except CheckFailed as e:
            if str(e) != last_error:  # the same refusal on every poll is said once
                print(f"watch: {e}", file=sys.stderr, flush=True)
            last_error = str(e)
        for r in (reporter, also):
            if r is not None:
                r.report()
        polls += 1
        if iterations is not None and polls >= iterations:
            return
        time.sleep(interval_s * rng.uniform(1 - jitter, 1 + jitter))
