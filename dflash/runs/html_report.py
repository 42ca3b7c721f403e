"""dflash-report: one self-contained HTML page (plots embedded, opens offline) and PNGs of a run dir.

    uv run dflash-report runs/demo                     # -> runs/demo/report/report.html + *.png
    uv run dflash-report runs/a runs/b --out cmp/      # two runs, curves overlaid

Reads only what a run writes (dflash.runs.rundir's names): config.json, preflight.json, metrics.jsonl
(a torn last line of a killed run is skipped), stopped.json, running.json, heldout.json,
checkpoints/ and drafter/. So it works on a finished run, a running one and a crashed one, and
says which. A plot whose data the run does not have (NVML memory on CPU, per-role rates of a
co-located run) says so in its panel instead of failing. matplotlib draws with the Agg backend.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import TopologyConfig
from dflash.errors import UsageError
from dflash.runs import rundir
from dflash.runs.metrics import read_metrics

# (file stem, title): every plot the report has, in page order
PLOTS = (
    ("loss", "Loss: train and held-out"),
    ("accept_len", "Acceptance length: simulated (train), held-out, real speculative decoding"),
    ("acc_slot", "Per-slot accuracy at the end"),
    ("throughput", "Tokens/s: overall and per role"),
    ("wait", "Wait fractions (split runs)"),
    ("memory", "GPU memory (NVML) against the memory model's prediction"),
    ("lr", "Learning rate"),
)


class ReportError(UsageError):
    """A path that is not a run dir; one line (exit 2)."""


@dataclass
class Run:
    path: Path
    label: str
    config: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    preflight: dict | None = None
    stopped: dict | None = None
    running: dict | None = None
    heldout: dict | None = None
    checkpoints: list[str] = field(default_factory=list)
    best: str | None = None
    final: bool = False
    torn_lines: int = 0
    skipped: str | None = None  # "skipped N bad metrics rows in FILE (first: line L, reason)"

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows where `key` is a finite number (every row has an integer step: read_metrics)."""
        xs, ys = [], []
        for r in self.rows:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(r["step"])
                ys.append(float(v))
        return xs, ys

    def last(self, key: str):
        for r in reversed(self.rows):
            if key in r:
                return r[key]
        return None


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def load_run(path: str | Path, label: str | None = None) -> Run:
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such run dir; give an output_dir of dflash-train")
    if not path.is_dir():
        raise ReportError(f"{path}: not a folder; give an output_dir of dflash-train")
    metrics = path / rundir.METRICS_NAME
    if not (path / rundir.CONFIG_NAME).is_file() and not metrics.is_file():
        raise ReportError(f"{path}: not a run dir (no {rundir.CONFIG_NAME} nor {rundir.METRICS_NAME}); give an "
                          "output_dir of dflash-train")
    run = Run(path, label or path.resolve().name)
    run.config = rundir.read_json_object(path / rundir.CONFIG_NAME) or {}
    read = read_metrics(path)
    run.rows, run.torn_lines, run.skipped = read.rows, read.torn, read.note(metrics)
    run.preflight = rundir.read_json_object(path / rundir.PREFLIGHT_NAME)
    run.stopped = rundir.read_stopped(path)
    run.running = rundir.read_running(path)
    run.heldout = rundir.read_json_object(path / rundir.HELDOUT_NAME)
    run.checkpoints = [p.name for p in rundir.list_checkpoints(path)]
    best = rundir.best_checkpoint(path)
    run.best = best.name if best else None
    run.final = (path / rundir.DRAFTER_DIR / "model.safetensors").is_file()
    return run


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def ending(run: Run) -> str:
    """How the run ended (or that it is running), in one line."""
    last = run.rows[-1].get("step") if run.rows else None
    at = f"step {last}" if last is not None else "before its first logged step"
    if run.running:
        here = run.running.get("host") == socket.gethostname()
        if run.running.get("error"):
            return f"failed at {at}: {run.running['error']}"
        if here and _pid_alive(run.running.get("pid")):
            return f"running (pid {run.running.get('pid')}), last logged {at}"
        if here:
            return (f"killed or crashed at {at} (process {run.running.get('pid')} is gone; no final drafter, no stop "
                    "marker); resume with dflash-train --resume latest")
        age = time.time() - (run.path / rundir.METRICS_NAME).stat().st_mtime if (run.path / rundir.METRICS_NAME).exists() else None
        return (f"running on {run.running.get('host')} or died there; last logged {at}"
                + (f", {age:.0f} s ago" if age is not None else ""))
    if run.stopped:
        return (f"stopped by {run.stopped.get('signal')} at step {run.stopped.get('step')} (exit 75); resume with "
                "dflash-train --resume latest")
    if run.final:
        return f"finished at {at}"
    return f"ended without finishing at {at} (no final drafter, no stop marker)"


# ---------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _no_data(ax, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, transform=ax.transAxes, fontsize=10, color="0.35")
    ax.set_xticks([])
    ax.set_yticks([])


def _lines(ax, runs: list[Run], keys: list[tuple[str, str]], why_none: str, style=None) -> bool:
    """Plot key series of every run (label: run label + name); returns whether anything was drawn."""
    drawn = False
    for i, run in enumerate(runs):
        for j, (key, name) in enumerate(keys):
            xs, ys = run.series(key)
            if not xs:
                continue
            label = name if len(runs) == 1 else f"{run.label}: {name}"
            marker = "o" if key.startswith("heldout") and len(xs) < 40 else None
            ax.plot(xs, ys, label=label, marker=marker, markersize=4, color=f"C{j}" if len(runs) == 1 else f"C{i * len(keys) + j}",
                    linestyle=["-", "--", ":", "-."][i % 4] if len(runs) > 1 else "-", linewidth=1.4)
            drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    else:
        _no_data(ax, why_none)
    return drawn


def plot_loss(ax, runs):
    _lines(ax, runs, [("loss", "train"), ("heldout_loss", "held-out")], "no loss logged yet")
    ax.set_ylabel("loss")


def plot_accept(ax, runs):
    _lines(ax, runs, [("accept_len", "simulated (train batches)"), ("heldout_accept_len", "held-out (simulated)"),
                      ("heldout_real_accept_len", "held-out (real decoding)"),
                      ("heldout_ddtree_accept_len", "held-out (DDTree real decoding, eval.ddtree_budget nodes)")],
           "no acceptance logged yet")
    ax.set_ylabel("acceptance length (tokens per verify step)")


def plot_acc_slot(ax, runs):
    drawn = False
    for i, run in enumerate(runs):
        for j, (key, name) in enumerate((("acc_slot", "train"), ("heldout_acc_slot", "held-out"))):
            acc = run.last(key)
            if not isinstance(acc, list) or not acc:
                continue
            label = name if len(runs) == 1 else f"{run.label}: {name}"
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=label, color=f"C{i * 2 + j}")
            drawn = True
    if drawn:
        ax.set_xlabel("slot (1 = first drafted token)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    else:
        _no_data(ax, "no per-slot accuracy logged yet")


def plot_throughput(ax, runs):
    per_role = any(run.series("target_tok_s_per_gpu")[0] for run in runs)
    _lines(ax, runs, [("tok_per_s", "overall"), ("target_tok_s_per_gpu", "target, per GPU"),
                      ("drafter_tok_s_per_gpu", "drafter, per GPU")], "no throughput logged yet")
    ax.set_ylabel("tokens/s")
    if not per_role and any(run.rows for run in runs):
        ax.set_title("co-located run: one role, no per-role rates", fontsize=9, color="0.35")


def plot_wait(ax, runs):
    drawn = _lines(ax, runs, [("drafter_wait_frac", "drafters waiting for features"),
                              ("target_wait_frac", "targets waiting to send")],
                   "no wait fractions: a co-located run has no ranks waiting on each other")
    if drawn:
        ax.set_ylabel("share of time")
        ax.set_ylim(0, 1)


def predicted_gib(config: dict) -> dict[str, float] | str:
    """{role: GiB} the memory model predicts for the run's config, or why it cannot say."""
    try:
        from dflash.config import RunConfig
        from dflash.memory.parts import role_need_bytes

        cfg = RunConfig.model_validate(config)
        return {role: role_need_bytes(cfg, role, "12.8") / 2**30 for role in cfg.topology.roles}
    except Exception as e:  # an old config, a target folder that moved: the plot says why
        return f"memory model unavailable: {' '.join(str(e).split())[:120]}"


def plot_memory(ax, runs):
    drawn = False
    notes = []
    for i, run in enumerate(runs):
        gpus = sorted({str(k) for r in run.rows for k in (r.get("nvml_used_gib") or {})})
        for j, gpu in enumerate(gpus):
            xs = [r["step"] for r in run.rows if gpu in (r.get("nvml_used_gib") or {})]
            ys = [r["nvml_used_gib"][gpu] for r in run.rows if gpu in (r.get("nvml_used_gib") or {})]
            ax.plot(xs, ys, label=f"{'' if len(runs) == 1 else run.label + ': '}NVML {gpu}", color=f"C{i * 4 + j}")
            drawn = True
        xs, ys = run.series("mem_gib")
        if xs:
            ax.plot(xs, ys, label=f"{'' if len(runs) == 1 else run.label + ': '}torch peak allocated", linestyle=":",
                    color=f"C{i * 4 + 3}")
            drawn = True
        if gpus or xs:
            pred = predicted_gib(run.config)
            if isinstance(pred, dict):
                for role, gib in pred.items():
                    ax.axhline(gib, linestyle="--", color="0.4", linewidth=1)
                    ax.text(0.01, gib, f" predicted {role} {gib:.1f} GiB", transform=ax.get_yaxis_transform(),
                            fontsize=8, va="bottom", color="0.3")
            else:
                notes.append(pred)
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        if notes:
            ax.set_title(notes[0], fontsize=8, color="0.35")
    else:
        devices = {run.config.get("device") for run in runs}
        _no_data(ax, "no GPU memory data: a CPU run (NVML and torch.cuda have nothing to say)" if devices == {"cpu"}
                 else "no GPU memory logged (NVML unavailable, or no step logged yet)")


def plot_lr(ax, runs):
    _lines(ax, runs, [("lr", "lr")], "no learning rate logged yet")
    ax.set_ylabel("learning rate")


DRAW = {"loss": plot_loss, "accept_len": plot_accept, "acc_slot": plot_acc_slot, "throughput": plot_throughput,
        "wait": plot_wait, "memory": plot_memory, "lr": plot_lr}


# A run's own text (its folder name, GPU names, config values) is drawn as is: never parsed as mathtext
# ($...$) nor handed to LaTeX, so a run named lr_$LR_$BS draws its name instead of failing.
PLAIN_TEXT = {"text.parse_math": False, "text.usetex": False}


def draw_plots(runs: list[Run], out: Path) -> dict[str, Path]:
    plt = _plt()
    files = {}
    with plt.rc_context(PLAIN_TEXT):
        for stem, title in PLOTS:
            fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
            DRAW[stem](ax, runs)
            fig.suptitle(title, fontsize=11)
            fig.tight_layout()
            path = out / f"{stem}.png"
            fig.savefig(path)
            plt.close(fig)
            files[stem] = path
    return files


# ---------------------------------------------------------------- the page


def layout_line(cfg: dict) -> str:
    """The run's layout in words, by the topology's own rule (TopologyConfig: layout and gpu_roles)."""
    try:
        topo = TopologyConfig.model_validate(_dict(cfg.get("topology")))
    except ValueError:
        return "unknown (the run's topology does not validate)"
    gpus: dict[str, list[str]] = {}
    for gpu, role in topo.gpu_roles.items():
        gpus.setdefault(role, []).append(gpu)
    if topo.layout == "split":
        return f"split: target GPUs {_joined(gpus['target'])}, drafter GPUs {_joined(gpus['drafter'])}"
    if topo.layout == "colocated-dp":
        return f"co-located data parallel: GPUs {_joined(gpus['colocated'])}, each target + drafter replica"
    return f"co-located on {cfg.get('device', '?')}"


def essentials(run: Run) -> list[tuple[str, str]]:
    """The run's snapshot essentials: what ran, where, with which build, and how it ended."""
    cfg = run.config
    pre = run.preflight or {}
    host = _dict(pre.get("host"))
    checks = {str(c.get("id")): c for c in _list(pre.get("checks")) if isinstance(c, dict)}
    layout = layout_line(cfg)
    gpus = checks.get("gpu-visibility", {}).get("summary") or (f"{host.get('gpus')} GPU(s)" if host else "unknown")
    steps = run.rows[-1].get("step") if run.rows else None
    rows = [
        ("run dir", str(run.path)),
        ("how it ended", ending(run)),
        ("steps logged", f"{steps}" + (f" ({run.torn_lines} torn line(s) skipped)" if run.torn_lines else "")
         + (f"; {run.skipped}" if run.skipped else "")),
        ("profile", str(cfg.get("profile") or pre.get("profile") or "?")),
        ("torch build", checks.get("torch-build", {}).get("summary") or "unknown (no preflight.json)"),
        ("GPUs", f"{gpus}; driver {host.get('nvidia_driver') or 'none'}"),
        ("layout", layout),
        ("target", str(_dict(cfg.get("target")).get("path", "?"))),
        ("drafter", ", ".join(f"{k} {v}" for k, v in _dict(cfg.get("drafter")).items())),
        ("data", str(_dict(cfg.get("data")).get("path", "?"))),
        ("held-out", (f"{run.heldout.get('samples')} samples of {run.heldout.get('source')}" if run.heldout
                      else "none ([eval] not configured)")),
        ("checkpoints", ", ".join(run.checkpoints) or "none"),
        ("best", run.best or "none"),
        ("host", f"{host.get('hostname', '?')}, python {host.get('python', '?')}, git {host.get('git_commit') or '?'}"),
    ]
    last = run.rows[-1] if run.rows else {}
    for key in ("loss", "accept_len", "heldout_accept_len", "heldout_real_accept_len", "heldout_ddtree_accept_len"):
        v = run.last(key)
        if isinstance(v, (int, float)):
            rows.append((f"last {key}", f"{v:.4f}"))
    if last.get("heldout_real_lossless") is False or last.get("heldout_ddtree_lossless") is False:
        rows.append(("LOSSLESS CHECK", "FAILED: speculative decoding differed from target-only greedy"))
    return rows


def _list(v) -> list:
    return v if isinstance(v, list) else []


def _joined(v) -> str:
    return ",".join(str(x) for x in _list(v)) if isinstance(v, list) else str(v)


def _img(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def render_html(runs: list[Run], pngs: dict[str, Path]) -> str:
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>dflash report: "
             + esc(" vs ".join(r.label for r in runs)) + "</title><style>"
             "body{font-family:sans-serif;max-width:1000px;margin:1em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin-bottom:1em}td{border-bottom:1px solid #ddd;padding:3px 8px;"
             "vertical-align:top;font-size:14px}td:first-child{color:#555;white-space:nowrap}"
             "img{max-width:100%;border:1px solid #eee}h2{margin-top:1.6em}pre{background:#f6f6f6;padding:8px;"
             "font-size:12px;overflow:auto}</style></head><body>"]
    parts.append(f"<h1>dflash report: {esc(' vs '.join(r.label for r in runs))}</h1>")
    parts.append(f"<p>written {esc(time.strftime('%Y-%m-%d %H:%M:%S %Z'))} by dflash-report</p>")
    for run in runs:
        parts.append(f"<h2>{esc(run.label)}</h2><table>")
        for k, v in essentials(run):
            parts.append(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>")
        parts.append("</table><details><summary>config</summary><pre>"
                     + esc(json.dumps(run.config, indent=2, sort_keys=True)) + "</pre></details>")
    for stem, title in PLOTS:
        parts.append(f"<h2 id='{stem}'>{esc(title)}</h2><img alt='{esc(title)}' src='{_img(pngs[stem])}'>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_report(run_dirs: list[str | Path], out: str | Path | None = None, log=print) -> Path:
    """Draw the plots and write report.html (and the PNGs) to `out` (default <first run dir>/report)."""
    if not 1 <= len(run_dirs) <= 2:
        raise ReportError(f"give one run dir, or two to compare; got {len(run_dirs)}")
    paths = [Path(p) for p in run_dirs]
    labels = [p.resolve().name for p in paths]
    if len(paths) == 2 and labels[0] == labels[1]:
        labels = [str(p) for p in paths]
    runs = [load_run(p, label) for p, label in zip(paths, labels)]
    for run in runs:
        if run.skipped:
            log(f"note: {run.skipped}")
    out = Path(out) if out is not None else paths[0] / rundir.REPORT_DIR
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"--out {out}: cannot create it ({e.strerror})") from None
    if not out.is_dir():
        raise ReportError(f"--out {out}: not a folder")
    pngs = draw_plots(runs, out)
    page = out / "report.html"
    tmp = out / ".report.html.tmp"
    tmp.write_text(render_html(runs, pngs))
    tmp.replace(page)
    return page
