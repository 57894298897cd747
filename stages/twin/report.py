"""The evaluation report people read: one self-contained HTML file (plots and videos inlined)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from stages.twin import video  # noqa: E402


def _inline(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def plot_scenarios(report: dict, path: Path, champion: Optional[str]) -> None:
    """Per-scenario success rate and mean return with their 95% intervals; the champion beside."""
    rows = report["scenarios"]
    x = np.arange(len(rows))
    width = 0.38 if champion else 0.6
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, label in ((axes[0], "success_rate", "success rate"), (axes[1], "mean_return", "mean return")):
        for k, (who, get) in enumerate([("challenger", lambda r: r), ("champion v" + str(champion), lambda r: r.get("champion"))]):
            if k and not champion:
                continue
            vals = [get(r) for r in rows]
            mean = np.array([v[key] for v in vals])
            ci = np.array([v[key + "_ci95"] for v in vals]).T
            ax.bar(x + (k - 0.5) * width * bool(champion), mean, width, label=who,
                   yerr=np.abs(ci - mean), capsize=3)
        ax.set_xticks(x, [r["scenario"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{label} (95% interval)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write(report: dict, task_ref: str, videos: list, out_dir: Path, champion: Optional[str]) -> Path:
    """Write ``report.html`` (and the plot and GIFs beside it) into ``out_dir``."""
    plot_scenarios(report, out_dir / "scenarios.png", champion)
    ci = lambda v: f"[{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
    metrics = report["metrics"]
    scen = _table(
        ["scenario", "episodes", "success", "95% CI", "return", "95% CI"]
        + [f"{m['name']} ({m['unit']}, 95% CI)" for m in metrics] + ["falls", "NaN", "at limit", "saturated",
         "smoothness", "latency p50/p99 ms"] + ([f"champion v{champion} success", "champion return", "Δ return"] if champion else []),
        [[r["scenario"], r["episodes"], f"{r['success_rate']:.2f}", ci(r["success_rate_ci95"]), f"{r['mean_return']:.1f}",
          ci(r["mean_return_ci95"])]
         + [f"{r['metrics'][m['name']]['mean']:.3f} {ci(r['metrics'][m['name']]['ci95'])}" for m in metrics]
         + [r["falls"], r["nan_actions"], f"{r['joint_limit_fraction']:.3f}",
          f"{r['saturation_fraction']:.3f}", f"{r['smoothness']:.3f}", f"{r['latency_ms_p50']:.3f} / {r['latency_ms_p99']:.3f}"]
         + ([f"{r['champion']['success_rate']:.2f}", f"{r['champion']['mean_return']:.1f}",
             f"{r['champion']['mean_difference']:+.1f}"] if champion else []) for r in report["scenarios"]])
    gate = _table(["check", "result", ""], [[c["name"], "pass" if c["passed"] else "FAIL", c["detail"]] for c in report["checks"]])
    s2r = report["sim_to_real"]
    real = ("<p>No reference robot for this twin's data: no sim-to-real check.</p>" if not s2r else
            "<p>Nominal episodes, same seeds, on the <b>stand-in</b> reference robot and on each model "
            f"(robot: mean return {s2r['reference']['mean_return']:.1f}, success {s2r['reference']['success_rate']:.2f}).</p>"
            + _table(["model", "mean return", "success", "mean |Δ return| to robot", "joint trajectory RMSE to robot"],
                     [[k, f"{s2r[k]['mean_return']:.1f}", f"{s2r[k]['success_rate']:.2f}", f"{s2r[k]['return_gap']:.2f}",
                       f"{s2r[k]['trajectory_rmse']:.4f}"] for k in ("twin", "uncalibrated")]))
    clips = []
    for title, traj in videos:
        gif = out_dir / f"{title.split()[0]}.gif"
        why = video.render(task_ref, traj.qpos, gif, report["control_period_s"], mocap=traj.mocap)
        caption = f"{title}: scenario {traj.scenario}, seed {traj.seed}, episode {traj.episode}, return {traj.episode_return:.1f}"
        clips.append(f"<figure><figcaption>{html.escape(caption)}</figcaption>"
                     + (f"<p class=novideo>No video: {html.escape(why)}</p>" if why else
                        f"<img class=video alt='{html.escape(title)}' src='{_inline(gif, 'image/gif')}'>") + "</figure>")
    verdict = "PASSED" if report["passed"] else "FAILED"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>sim2edge evaluation: {html.escape(task_ref)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #bbb;padding:3px 8px;font-size:13px}} figure{{display:inline-block;margin:0 2em 0 0}}</style></head><body>
<h1>Evaluation of {html.escape(task_ref)}: <span id=verdict>{verdict}</span></h1>
<p>Policy digest {report['policy_digest'][:12]}, twin digest {str(report['twin_digest'])[:12]}, seed {report['seed']},
control period {report['control_period_s'] * 1e3:.1f} ms, in-loop latency p50 {report['latency_ms_p50']:.3f} ms /
p99 {report['latency_ms_p99']:.3f} ms.</p>
<h2>Scenarios</h2><img id=plot alt="per-scenario success and return" src="{_inline(out_dir / 'scenarios.png', 'image/png')}">
{scen}<h2>Gate</h2>{gate}<h2>Sim-to-real</h2>{real}<h2>Episodes</h2>{''.join(clips) or '<p>Video not requested.</p>'}
</body></html>"""
    (out_dir / "report.html").write_text(page)
    return out_dir / "report.html"


def write_hil(hil: dict, out: Path) -> Path:
    """Write ``out`` (HTML): per scenario in-process and HIL side by side, the link's counts, and the HIL gate
    (``hil``: ``HilReport.to_json()`` parsed)."""
    ci = lambda v: f"[{v[0]:.1f}, {v[1]:.1f}]"  # noqa: E731
    metric = lambda m: f"{m['mean']:.3f} [{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}]"  # noqa: E731
    names = list(hil["scenarios"][0]["hil"]["metrics"]) if hil["scenarios"] else []
    rows = [[r["scenario"], r["hil"]["episodes"], f"{r['in_process']['success_rate']:.2f}", f"{r['hil']['success_rate']:.2f}",
             f"{r['in_process']['mean_return']:.1f} {ci(r['in_process']['mean_return_ci95'])}",
             f"{r['hil']['mean_return']:.1f} {ci(r['hil']['mean_return_ci95'])}", r["in_process"]["falls"], r["hil"]["falls"],
             f"{r['hil']['deadline_misses']}/{r['hil']['steps']}", r["hil"]["late_actions"], r["hil"]["lost_actions"],
             f"{r['hil']['rtt_ms_p50']:.1f} / {r['hil']['rtt_ms_p99']:.1f} / {r['hil']['rtt_ms_max']:.1f}",
             (r["device"] or {}).get("act_p99_us", "-"),
             "; ".join(f"{s['device']}: {', '.join(map(str, s['episodes']))}" for s in r["shards"])]
            + [metric(r[side]["metrics"][n]) for n in names for side in ("in_process", "hil")]
            for r in hil["scenarios"]]
    scen = _table(["scenario", "episodes", "success in-process", "success HIL", "return in-process (95%)",
                   "return HIL (95%)", "falls in-process", "falls HIL", "deadline misses", "late", "lost",
                   "round trip p50 / p99 / max ms", "device act() p99 µs", "device: episodes"]
                  + [f"{n} {side} (95%)" for n in names for side in ("in-process", "HIL")], rows)
    gate = _table(["check", "result", ""], [[c["name"], "pass" if c["passed"] else "FAIL", c["detail"]] for c in hil["checks"]])
    verdict = "PASSED" if hil["passed"] else "FAILED"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>sim2edge HIL: {html.escape(hil['task'])}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #bbb;padding:3px 8px;font-size:13px}}</style></head><body>
<h1>Hardware-in-the-loop evaluation of {html.escape(hil['task'])}: <span id=verdict>{verdict}</span></h1>
<p>Device {html.escape(hil['device'])} running {html.escape(hil.get('device_runtime') or 'an unnamed runtime')},
seed {hil['seed']}, control period {hil['period_s'] * 1e3:.1f} ms, round trip p99 {hil['round_trip_ms_p99']:.1f} ms,
paired return difference HIL − in-process 95% CI {ci(hil['paired_difference_ci95'])}.</p>
<h2>Scenarios: in-process beside HIL, same seeds</h2>{scen}<h2>HIL gate</h2>{gate}
</body></html>"""
    out.write_text(page)
    return out
