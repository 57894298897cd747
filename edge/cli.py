"""``sim2edge-agent``: pull a policy onto this device, show, verify, repair, roll back and clean up.

Exit codes: 0 done; 1 refused (a check refused what the registry offered, or the state asked about
is not there: the message names the check); 2 error (bad arguments or input, a local file, the
registry rejecting the request, a full disk); 3 unavailable (registry unreachable or too slow, backing off, or
another agent holds the store: try again later; ``current`` is unchanged)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import List, Optional

from edge.errors import CheckFailed
from edge.signing import load_trusted
from edge.store import DeviceStore

REFUSED, ERROR, UNAVAILABLE = 1, 2, 3

DEFAULT_ROOT = os.environ.get("SIM2EDGE_DEVICE_ROOT", "/var/lib/sim2edge")


def pull_options(args: argparse.Namespace):
    from edge.pull import PullOptions

    return PullOptions(transfer_options(args), backoff_base_s=args.backoff, ignore_backoff=args.ignore_backoff,
                       retry_failed=args.retry_failed, allow_failed_gate=args.allow_failed_gate,
                       min_free_bytes=args.min_free)


def transfer_options(args: argparse.Namespace):
    from edge.registry_client import TransferOptions

    return TransferOptions(attempts=args.attempts, timeout_s=args.timeout, max_bytes=args.max_bytes,
                           backoff_base_s=args.retry_base, deadline_s=args.deadline, min_rate_bps=args.min_rate)


def tuf_source(args: argparse.Namespace):
    """``--tuf URL --tuf-root ROOT.json``: the TUF client (edge/tuf_client.py) that pull uses instead of MLflow;
    ``--device-id`` and ``--label`` place the device in a rollout's rings."""
    if not args.tuf:
        return None
    if not args.tuf_root:
        raise ValueError("--tuf needs --tuf-root ROOT.json (the repository's trusted root metadata)")
    from edge.mqtt_report import parse_labels
    from edge.tuf_client import TufClient

    labels = parse_labels(args.label)
    return lambda store: TufClient(args.tuf, args.tuf_root, store, transfer_options(args), args.device_id, labels)


def mqtt_reporter(args: argparse.Namespace):
    """``--report mqtt://HOST:PORT``: the reporter of edge/mqtt_report.py (None without ``--report``)."""
    from edge import mqtt_report

    labels = mqtt_report.parse_labels(args.label)
    if not args.report:
        return None
    broker = mqtt_report.parse_broker(args.report, args.mqtt_ca)
    mqtt_report.topic(args.fleet, args.device_id)
    try:
        import paho.mqtt.client  # noqa: F401
    except ImportError:
        raise ValueError("--report mqtt:// needs paho-mqtt: pip install 'sim2edge-agent[mqtt]'") from None
    from edge.report import device_state

    store, trusted = DeviceStore(Path(args.root)), load_trusted(args.trust)
    return mqtt_report.MqttReporter(Path(args.root), broker, args.fleet, args.device_id,
                                    mqtt_report.read_password(args.mqtt_password_file, dict(os.environ)), labels,
                                    lambda: device_state(store, trusted, args.device_id))


def _pull(args: argparse.Namespace) -> int:
    from edge.pull import pull

    reporter = mqtt_reporter(args)
    try:
        result = pull(args.ref, args.registry or args.tuf, Path(args.root), load_trusted(args.trust),
                      args.skip_target_check, pull_options(args), tuf_source(args))
    finally:
        if reporter is not None:
            reporter.report()
    if not result.changed:
        print(f"{result.policy} v{result.version} is already active at {result.path}")
        return 0
    s = result.smoke
    print(f"activated {result.policy} v{result.version} at {result.path}\n"
          f"  smoke test: {s.runtime}, golden max error {s.max_abs_error:.2e}, "
          f"latency p50 {s.latency_p50_s * 1e6:.0f} us, p99 {s.latency_p99_s * 1e6:.0f} us")
    return 0


def _status(args: argparse.Namespace) -> int:
    store = DeviceStore(Path(args.root))
    manifest = store.current_manifest()
    if manifest is None:
        print(f"no active policy in {args.root}")
        return 1
    last = next((e for e in reversed(store.history()) if e["event"] == "activate"), {})
    previous = store.link("previous")
    info = {
        "policy": manifest["policy"]["name"],
        "version": manifest["policy"]["version"],
        "path": str(store.link("current")),
        "target": manifest["target"]["name"],
        "source": last.get("source"),
        "run_id": (manifest.get("provenance") or {}).get("mlflow_run_id"),
        "bundle_sha256": last.get("bundle_sha256"),
        "evaluation": manifest.get("evaluation"),
        "previous": str(previous) if previous else None,
        "known_bad": [f"{e['policy']} v{e['version']} ({e['check']}, {e['count']}x, sha256 {e['bundle_sha256'][:12]})"
                      for e in sorted(store.failed_versions().values(), key=lambda e: e.get("time", 0))],
    }
    print(json.dumps(info, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from edge.pull import rollback

    path = rollback(Path(args.root), load_trusted(args.trust), args.to)
    print(f"rolled back: current -> {path}")
    return 0


def _history(args: argparse.Namespace) -> int:
    for event in DeviceStore(Path(args.root)).history():
        print(json.dumps(event, sort_keys=True))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from edge import bundle

    current = DeviceStore(Path(args.root)).link("current")
    if current is None:
        print(f"no active policy in {args.root}")
        return 1
    manifest = bundle.verify_dir(current, load_trusted(args.trust))
    print(f"ok: {manifest['policy']['name']} v{manifest['policy']['version']} at {current} verifies")
    return 0


def loop_outputs(args: argparse.Namespace):
    """``--telemetry`` and ``--registry`` of ``run`` and ``ros2``: (Recorder arguments or None, ReportTo or None)."""
    from edge.control import ReportTo

    telemetry = None
    if args.telemetry:
        telemetry = dict(device_id=args.device_id, rows_per_file=args.telemetry_rows,
                         cap_bytes=int(args.telemetry_cap_mb * (1 << 20)), format=args.telemetry_format)
    return telemetry, ReportTo(args.registry, args.device_id, args.report_every) if args.registry else None


def _run(args: argparse.Namespace) -> int:
    from edge.control import run

    telemetry, report = loop_outputs(args)
    stats = run(Path(args.root), args.listen, args.watchdog_periods, args.duration, args.stop_after_silence,
                args.stats, telemetry, report, args.stats_window)
    print(json.dumps(stats, sort_keys=True))
    return 0


def _ros2(args: argparse.Namespace) -> int:
    try:
        from edge import ros2
    except ImportError as e:
        print(f"sim2edge-agent: {e}", file=sys.stderr)
        return ERROR
    stats = ros2.serve(Path(args.root), args.state_topic, args.command_topic, args.action_topic, args.action_type,
                       args.watchdog_periods, args.duration, args.stats, args.stats_window, *loop_outputs(args))
    print(json.dumps(stats, sort_keys=True))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from edge.bench import bench

    r = bench(Path(args.root), args.iterations)
    if args.json:
        print(json.dumps(r, sort_keys=True))
    else:
        print(f"{r['policy']} v{r['version']} on {r['runtime']} {r['providers']}, {r['iterations']} calls each\n"
              f"  bare session.run  p50 {r['bare_p50_us']:8.1f} us  p99 {r['bare_p99_us']:8.1f} us\n"
              f"  Policy.act()      p50 {r['act_p50_us']:8.1f} us  p99 {r['act_p99_us']:8.1f} us\n"
              f"  ratio act/bare    p50 {r['ratio_p50']:.2f}x      p99 {r['ratio_p99']:.2f}x")
    return 0


def _upload(args: argparse.Namespace) -> int:
    from edge.registry_client import TransferOptions
    from edge.telemetry import Uploader

    store = DeviceStore(Path(args.root))
    task = args.task or (store.current_manifest() or {}).get("policy", {}).get("task")
    if not task:
        raise ValueError("no --task given and no active policy to read it from")
    with store.locked():
        runs = Uploader(Path(args.root), args.registry, task, args.device_id,
                        TransferOptions(attempts=args.attempts, timeout_s=args.timeout,
                                        deadline_s=args.deadline)).upload()
    print(f"uploaded telemetry in {len(runs)} run(s): {', '.join(runs) if runs else 'nothing pending'}")
    return 0


def _watch(args: argparse.Namespace) -> int:
    from edge import mqtt_report
    from edge.pull import watch

    watch(args.ref, args.registry or args.tuf, Path(args.root), load_trusted(args.trust), args.interval, args.jitter,
          args.skip_target_check, pull_options(args), args.iterations,
          device_id=None if args.no_report else args.device_id, source=tuf_source(args), also=mqtt_reporter(args),
          labels=mqtt_report.parse_labels(args.label))
    return 0


def _repair(args: argparse.Namespace) -> int:
    from edge.repair import repair

    report = repair(Path(args.root), args.registry, load_trusted(args.trust), transfer_options(args))
    for damage in report.repaired:
        print(f"repaired {damage.policy} v{damage.version} at {damage.path} (was: {damage.detail})")
    for failure in report.failed:
        print(f"not repaired: {failure}", file=sys.stderr)
    if not report.repaired and not report.failed:
        print("nothing to repair: every installed copy verifies")
    return 1 if report.failed else 0


def _gc(args: argparse.Namespace) -> int:
    store = DeviceStore(Path(args.root))
    with store.locked():
        removed = store.gc(args.keep)
    print("removed: " + (", ".join(removed) if removed else "nothing"))
    return 0


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attempts", type=int, default=4, help="tries per registry request (default: %(default)s)")
    p.add_argument("--retry-base", type=float, default=0.5, metavar="S",
                   help="retry k waits uniform(0, min(8, S*2^k)) seconds (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=20.0, metavar="S",
                   help="socket timeout per connect/read (default: %(default)s)")
    p.add_argument("--max-bytes", type=int, default=1 << 30, help="largest bundle accepted (default: %(default)s)")
    p.add_argument("--backoff", type=float, default=30.0, metavar="S",
                   help="after n failed pulls the next waits ~S*2^(n-1) s, at most 30 min (default: %(default)s)")
    p.add_argument("--ignore-backoff", action="store_true", help="try now even if the last pulls failed")
    p.add_argument("--deadline", type=float, default=120.0, metavar="S",
                   help="overall bound on a registry request with its retries, and the fixed part of a download's "
                        "(default: %(default)s)")
    p.add_argument("--min-rate", type=float, default=32768.0, metavar="B/S",
                   help="slowest transfer accepted: a download of n bytes may take --deadline + n / B/S seconds "
                        "(default: %(default)s)")


def add_install_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-target-check", action="store_true",
                   help="development hosts only: install although this is not the bundle's Jetson target")
    p.add_argument("--retry-failed", action="store_true",
                   help="try a version again although its bundle failed a check here before (see failed.json; "
                        "watch: on its first poll)")
    p.add_argument("--allow-failed-gate", action="store_true",
                   help="install a bundle whose signed manifest records a failed evaluation gate (a challenger)")
    p.add_argument("--min-free", type=int, metavar="BYTES",
                   help="refuse (check disk) before downloading unless the bundle and its unpacked copy leave BYTES "
                        "free on the store's filesystem")


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """Where bundles come from: ``--registry`` (MLflow) or ``--tuf`` with ``--tuf-root``."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--registry", help="MLflow tracking server URL, e.g. http://127.0.0.1:5000")
    where.add_argument("--tuf", metavar="URL", help="TUF repository written by `sim2edge publish`, e.g. "
                                                    "http://127.0.0.1:8080 (see edge/tuf_client.py)")
    p.add_argument("--tuf-root", type=Path, metavar="ROOT.json",
                   help="the TUF repository's trusted root metadata (with --tuf; used on first contact only)")


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """``--report mqtt://HOST:PORT`` and what goes with it (see edge/mqtt_report.py)."""
    p.add_argument("--report", metavar="URL", help="also publish the device's state, retained, to this MQTT broker: "
                                                   "mqtt://HOST:PORT or mqtts://HOST:PORT (see edge/mqtt_report.py)")
    p.add_argument("--fleet", default="default", help="MQTT topic sim2edge/<fleet>/<device id>/state "
                                                      "(default: %(default)s)")
    p.add_argument("--label", action="append", metavar="KEY=VALUE",
                   help="a label carried in the report (rings select on them); repeatable; [a-z0-9_.-]")
    p.add_argument("--mqtt-password-file", type=Path, metavar="PATH",
                   help="the device's MQTT password (user: the device id); default: $SIM2EDGE_MQTT_PASSWORD")
    p.add_argument("--mqtt-ca", metavar="PEM", help="CA bundle for mqtts:// (default: the system's)")


def add_loop_output_arguments(p: argparse.ArgumentParser) -> None:
    """What ``run`` and ``ros2`` record and report besides serving."""
    p.add_argument("--telemetry", action="store_true", help="record observations, actions and timing "
                   "under <root>/telemetry/pending (see edge/telemetry.py)")
    p.add_argument("--telemetry-format", choices=("npz", "mcap"), default="npz",
                   help="npz, or mcap with ROS 2 schemas for Foxglove and ros2 bag (needs the mcap extra; see "
                        "edge/telemetry_mcap.py) (default %(default)s)")
    p.add_argument("--telemetry-rows", type=int, default=3000, help="control steps per file (default %(default)s)")
    p.add_argument("--telemetry-cap-mb", type=float, default=256.0,
                   help="stop recording when pending files reach this size (default %(default)s)")
    p.add_argument("--stats-window", type=int, default=10000, metavar="N",
                   help="latency percentiles over the last N periods (default %(default)s)")
    p.add_argument("--registry", help="report the loop's statistics to this MLflow server (tag "
                                      "sim2edge.control.<device id>; see edge/report.py)")
    p.add_argument("--report-every", type=float, default=60.0, metavar="S",
                   help="seconds between reports, and one at exit (default %(default)s)")
    p.add_argument("--device-id", default=socket.gethostname(), help="default: the host name")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sim2edge-agent", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("pull", help="download, verify, smoke-test and activate a policy")
    pl.add_argument("ref", help="<policy>@<alias> or <policy>@<version>; with --tuf: <policy> (latest) or "
                                "<policy>@<version>")
    add_source_arguments(pl)
    pl.add_argument("--root", default=DEFAULT_ROOT, help="device store (default: %(default)s)")
    pl.add_argument("--trust", action="append", required=True, type=Path,
                    help="trusted Ed25519 public key (PEM); repeat for key rotation")
    add_install_arguments(pl)
    pl.add_argument("--device-id", default=socket.gethostname(), help="with --report (default: the host name)")
    add_report_arguments(pl)
    add_transfer_arguments(pl)
    pl.set_defaults(func=_pull)
    st = sub.add_parser("status", help="show the active policy and where it came from")
    st.add_argument("--root", default=DEFAULT_ROOT)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_status)
    rb = sub.add_parser("rollback", help="re-verify and activate the previous (or a named installed) version")
    rb.add_argument("--root", default=DEFAULT_ROOT)
    rb.add_argument("--trust", action="append", required=True, type=Path)
    rb.add_argument("--to", help="installed version to activate (default: previous)")
    rb.set_defaults(func=_rollback)
    hi = sub.add_parser("history", help="print the journal: pulls, activations, refusals, rollbacks")
    hi.add_argument("--root", default=DEFAULT_ROOT)
    hi.set_defaults(func=_history)
    ve = sub.add_parser("verify", help="re-verify the active bundle's signature and files")
    ve.add_argument("--root", default=DEFAULT_ROOT)
    ve.add_argument("--trust", action="append", required=True, type=Path)
    ve.set_defaults(func=_verify)
    rn = sub.add_parser("run", help="serve the active policy: observations in, actions out, at the bundle's rate")
    rn.add_argument("--root", default=DEFAULT_ROOT)
    rn.add_argument("--listen", default="udp://127.0.0.1:5600",
                    help="udp://HOST:PORT or unix:///PATH (wire format: see edge/control.py; default %(default)s)")
    rn.add_argument("--watchdog-periods", type=int, default=5,
                    help="no observation for this many periods: send the safe default (default %(default)s)")
    rn.add_argument("--stop-after-silence", type=float, metavar="S", help="exit after S seconds without observations")
    rn.add_argument("--duration", type=float, metavar="S", help="exit after S seconds (default: until SIGTERM)")
    rn.add_argument("--stats", type=Path, help="also write the final statistics (JSON) here")
    add_loop_output_arguments(rn)
    rn.set_defaults(func=_run)
    r2 = sub.add_parser("ros2", help="serve the active policy as a ROS 2 node: JointState in, actions out "
                                     "(needs the ROS 2 wheels; see edge/ros2.py)")
    r2.add_argument("--root", default=DEFAULT_ROOT)
    r2.add_argument("--state-topic", default="/joint_states", help="sensor_msgs/JointState (default %(default)s)")
    r2.add_argument("--command-topic", default="/sim2edge/command",
                    help="std_msgs/Float64MultiArray: the contract's command terms (default %(default)s)")
    r2.add_argument("--action-topic", default="/sim2edge/action", help="default %(default)s")
    r2.add_argument("--action-type", choices=("float64_array", "joint_trajectory"), default="float64_array",
                    help="std_msgs/Float64MultiArray or trajectory_msgs/JointTrajectory (default %(default)s)")
    r2.add_argument("--watchdog-periods", type=int, default=5,
                    help="no JointState for this many periods: publish the safe default (default %(default)s)")
    r2.add_argument("--duration", type=float, metavar="S", help="exit after S seconds (default: until SIGTERM)")
    r2.add_argument("--stats", type=Path, help="also write the final statistics (JSON) here")
    add_loop_output_arguments(r2)
    r2.set_defaults(func=_ros2)
    be = sub.add_parser("bench", help="latency p50/p99 of Policy.act() vs the bare runtime call")
    be.add_argument("--root", default=DEFAULT_ROOT)
    be.add_argument("--iterations", type=int, default=20000)
    be.add_argument("--json", action="store_true")
    be.set_defaults(func=_bench)
    up = sub.add_parser("upload", help="send recorded telemetry to the registry (resumable; deletes only "
                                       "what the registry confirmed)")
    up.add_argument("--registry", required=True)
    up.add_argument("--root", default=DEFAULT_ROOT)
    up.add_argument("--task", help="default: the active policy's task")
    up.add_argument("--device-id", default=socket.gethostname(), help="default: the host name")
    up.add_argument("--attempts", type=int, default=5)
    up.add_argument("--timeout", type=float, default=20.0)
    up.add_argument("--deadline", type=float, default=120.0, metavar="S",
                    help="overall bound on each registry request with its retries (default: %(default)s)")
    up.set_defaults(func=_upload)
    wa = sub.add_parser("watch", help="poll an alias and pull+activate new versions with the same checks")
    wa.add_argument("ref", help="<policy>@<alias>; with --tuf: <policy> (latest)")
    add_source_arguments(wa)
    wa.add_argument("--root", default=DEFAULT_ROOT)
    wa.add_argument("--trust", action="append", required=True, type=Path)
    wa.add_argument("--interval", type=float, default=60.0, help="seconds between polls (default %(default)s)")
    wa.add_argument("--jitter", type=float, default=0.2, help="each wait is interval x uniform(1-j, 1+j)")
    wa.add_argument("--iterations", type=int, help="stop after this many polls (default: never)")
    add_install_arguments(wa)
    wa.add_argument("--device-id", default=socket.gethostname(),
                    help="report this device's state to the registry under this id (default: the host name)")
    wa.add_argument("--no-report", action="store_true", help="do not report the device's state to MLflow "
                                                             "(with --tuf: never)")
    add_report_arguments(wa)
    add_transfer_arguments(wa)
    wa.set_defaults(func=_watch)
    rp = sub.add_parser("repair", help="download installed copies that no longer verify again (never current)")
    rp.add_argument("--registry", required=True)
    rp.add_argument("--root", default=DEFAULT_ROOT)
    rp.add_argument("--trust", action="append", required=True, type=Path)
    add_transfer_arguments(rp)
    rp.set_defaults(func=_repair)
    gc = sub.add_parser("gc", help="delete old installed versions (never current or previous)")
    gc.add_argument("--root", default=DEFAULT_ROOT)
    gc.add_argument("--keep", type=int, default=3, help="versions to keep per policy (default: %(default)s)")
    gc.set_defaults(func=_gc)
    return p


def exit_code(e: Exception) -> int:
    """Refused (1), error (2) or unavailable (3): see the module docstring."""
    from edge.errors import RegistryError, RegistryUnavailable

    if isinstance(e, RegistryUnavailable) or (isinstance(e, CheckFailed) and e.check in ("backoff", "lock")):
        return UNAVAILABLE
    if isinstance(e, RegistryError) or not isinstance(e, CheckFailed) or e.check == "disk":
        return ERROR
    return REFUSED


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckFailed, ValueError, OSError) as e:
        print(f"sim2edge-agent: {e}", file=sys.stderr)
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
