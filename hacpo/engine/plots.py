"""PNG plots of a run directory: per-agent reward curves, capability ratios over steps, and
self vs cross sequence-ratio histograms (the paper's Appendix C view)."""
from __future__ import annotations

import os

import numpy as np

from .checkpoint import _write_atomic
from .errors import missing_package
from .metrics import read_metrics


def subplots(nrows: int = 1, ncols: int = 1, figsize=None, squeeze: bool = True):
    """``(fig, axes)`` as ``pyplot.subplots`` gives them, on a figure of its own drawn by Agg.
    Not pyplot: ``matplotlib.use("Agg")`` would switch the caller's backend (a notebook's
    inline one, QtAgg) for the rest of the process, and pyplot's list of open figures is
    shared with the caller's own plots (unsafe when train() runs in a thread)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze)


def plot_or_say(plot, data, path: str, echo, complete: str) -> None:
    """``plot(data, path)``; without matplotlib one line saying the plot is not written and
    ``complete`` (the results) are: not a traceback after every run has finished."""
    try:
        plot(data, path)
    except ImportError as e:
        echo(f"[plots] not written: {missing_package('matplotlib', path, e)} ({complete} are "
             f"complete)")


def save_figure(fig, path: str) -> None:
    """Lay out ``fig`` and write it to ``path`` as a PNG atomically (a crash or a reader never
    sees half a file; the old one stays until the new one is whole). A figure of
    ``subplots`` is in no pyplot list: nothing to close, it is freed with its last reference."""
    fig.tight_layout()
    _write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))


# The ratio histograms' bins: sequence ratios s = exp(log-ratio) on [0, 2.5] in 80 bins, s
# above 2.5 counted in the last one. A run keeps counts per learner and part (self / cross), not
# every sample's ratio: its memory and checkpoint stay the same size however long it runs.
RATIO_EDGES = np.linspace(0.0, 2.5, 81)
RATIO_FILE = "ratio_histograms.npz"     # "edges" and one count array per "<agent>/<part>"
# what a run with plots=true writes into its run dir when it finishes
REWARD_PLOT, OMEGA_PLOT, RATIO_PLOT = ("reward_curves.png", "capability_ratios.png",
                                      "ratio_histograms.png")
PLOT_FILES = (REWARD_PLOT, OMEGA_PLOT, RATIO_PLOT, RATIO_FILE)


def ratio_counts(log_ratios: np.ndarray) -> np.ndarray:
    """[80] int64 counts of sequence log-ratios ``log_ratios`` [N] over RATIO_EDGES."""
    s = np.clip(np.exp(np.asarray(log_ratios, dtype=np.float64)), 0.0, RATIO_EDGES[-1])
    return np.histogram(s, bins=RATIO_EDGES)[0].astype(np.int64)


def plot_run(out_dir: str, agent_names: list[str]) -> list[str]:
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    written = []
    if rows:
        steps = [r["step"] for r in rows]
        fig, ax = subplots(figsize=(7, 4))
        for name in agent_names:
            ys = [r.get(f"reward/{name}") for r in rows]
            ax.plot(steps, ys, label=name, alpha=0.35)
            k = min(10, len(ys))
            if k > 1:
                sm = np.convolve(np.array(ys, dtype=float), np.ones(k) / k, mode="valid")
                ax.plot(steps[k - 1:], sm, label=f"{name} (moving avg {k})")
        ax.set_xlabel("step"), ax.set_ylabel("mean training reward"), ax.legend()
        ax.set_title("Per-agent training reward")
        p = os.path.join(out_dir, REWARD_PLOT)
        save_figure(fig, p)
        written.append(p)

        keys = sorted(k for k in rows[-1] if k.startswith("omega/"))
        if keys:
            fig, ax = subplots(figsize=(7, 4))
            for k in keys:
                ax.plot(steps, [r.get(k) for r in rows], label=k[len("omega/"):])
            ax.set_yscale("log"), ax.set_xlabel("step"), ax.set_ylabel("omega[source, learner]")
            ax.set_title("Capability ratios"), ax.legend(fontsize=8)
            p = os.path.join(out_dir, OMEGA_PLOT)
            save_figure(fig, p)
            written.append(p)

    rpath = os.path.join(out_dir, RATIO_FILE)
    if os.path.exists(rpath):
        data = np.load(rpath)
        edges = data["edges"]
        fig, axes = subplots(1, len(agent_names), figsize=(5 * len(agent_names), 3.6),
                             squeeze=False)
        for ax, name in zip(axes[0], agent_names):
            for kind in ("self", "cross"):
                key = f"{name}/{kind}"
                if key in data and data[key].sum():
                    c = data[key]
                    ax.stairs(c / (c.sum() * np.diff(edges)), edges, fill=True, alpha=0.55,
                              label=f"{kind} (n={int(c.sum())})")     # a density, as hist's
            ax.set_title(f"learner {name}: sequence ratio s"), ax.set_xlabel("s (clipped to 2.5)")
            ax.legend()
        p = os.path.join(out_dir, RATIO_PLOT)
        save_figure(fig, p)
        written.append(p)
    return written
