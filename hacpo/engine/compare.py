"""hacpo compare — the same run budget under several algorithms and seeds, evaluated on the
held-out set; a Table-1-style markdown table (mean ± 95% CI over seeds, per agent) and a plot.

Warm-up checkpoints are shared: they depend on the agents, warm-up and data config only."""
from __future__ import annotations

import copy
import json
import math
import os
import statistics

from .checkpoint import ensure_dir, write_text_atomic
from .config import preset, preset_settings
from .plots import plot_or_say, save_figure, subplots
from .run_config import TrainConfig, config_hash, resolve_paths

# two-sided 95% Student-t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    if df <= 0:
        return float("nan")
    return _T95.get(df) or _T95[max(k for k in _T95 if k <= df)]


def mean_ci(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def warnings_only(echo, prefix: str):
    """An ``echo`` for a run inside `hacpo compare` / `hacpo profile`: its progress lines are
    dropped, its ``[warn]`` lines (e.g. fewer prompts than minibatches) are passed on, after
    ``prefix`` naming the run."""
    def passed(line="", *_):
        if isinstance(line, str) and line.startswith("[warn]"):
            echo(prefix + line)
    return passed


def run_compare(base: TrainConfig, algorithms: list[str], seeds: list[int], root: str, *,
                pass_k: int = 4, keep: dict | None = None,
                accept_encoding_change: bool | list[str] = False, echo=print) -> dict:
    """Train ``base`` under every algorithm preset x seed (``with_algorithm``, ``keep``: its
    dotted algorithm overrides kept for every algorithm) into ``root/<algo>-seed<seed>``.

    Resumable: a run that finished with exactly this config (the hash its ``summary.json``
    records) is reused;
    one that did not finish, or whose config differs only where a resume may change it (e.g.
    more steps), is resumed from its checkpoint; any other difference is the trainer's
    "cannot resume" error naming the keys (choose another ``root``). A run to resume whose
    agent's tokenizer encodes prompts otherwise than at its checkpoint is refused unless
    ``accept_encoding_change`` (``train``'s: True or agent names; said per agent, recorded in
    its checkpoints); a finished run reused is not trained again, so nothing of it is checked
    or recorded."""
    from .errors import user_errors
    from .run_config import accepted_encoding_agents
    from .signals import stop_between_runs
    from .trainer import train
    with user_errors(ValueError, OSError):
        for what, xs in (("algorithm", algorithms), ("seed", seeds)):
            check_run_list("compare", what, xs)
        # every run's config (each algorithm's name and settings, each seed's range) before
        # any run starts: a bad last seed must not end a compare after hours of its runs
        planned = [(algo, seed, with_algorithm(
            base.override({"seed": seed, "out_dir": os.path.join(root, f"{algo}-seed{seed}"),
                           "progress": False, "eval_pass_k": pass_k,
                           "cache_dir": base.cache_dir}), algo, keep))
            for algo in algorithms for seed in seeds]
        accepted_encoding_agents(accept_encoding_change, [a.policy.name for a in base.agents])
        if base.data.eval_size == 0:
            raise ValueError("hacpo compare compares held-out accuracy, but the config has no "
                             "held-out set (data.eval_size=0)")
        if os.path.exists(root) and not os.path.isdir(root):
            raise ValueError(f"out_dir {root} is a file, not a directory for the compare runs")
        ensure_dir(root, "compare out_dir")   # a dangling link, a read-only parent: one line
    results: dict[str, dict[str, list[dict]]] = {}
    for algo, seed, cfg in planned:
        out = cfg.out_dir
        if _finished_with(out, cfg):          # finished earlier with this config: reuse
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
            echo(f"[compare] {algo} seed {seed}: reusing the finished run in {out}")
        else:
            stop_between_runs(root)     # a SIGUSR1 after the run before took its checkpoint
            echo(f"[compare] {algo} seed {seed} -> {out}")
            summary = train(cfg, resume=True, accept_encoding_change=accept_encoding_change,
                            echo=warnings_only(echo, f"[compare] {algo} seed {seed}: "))
        for agent, r in summary["after"].items():
            results.setdefault(algo, {}).setdefault(agent, []).append(
                {"seed": seed, **r, "before": summary["before"][agent]["accuracy"]})
    table = render_table(results, pass_k)
    write_text_atomic(os.path.join(root, "compare.json"), json.dumps(results, indent=2))
    write_text_atomic(os.path.join(root, "compare.md"), table)
    plot_or_say(plot_compare, results, os.path.join(root, "compare.png"), echo,
                "compare.md and compare.json")
    echo(table)
    return results


def _finished_with(out: str, cfg: TrainConfig) -> bool:
    """Did the run in ``out`` finish with exactly ``cfg`` (its summary.json names the config
    it finished with; a run resumed since with another config, interrupted or not, does not
    match)?"""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            finished = json.load(f).get("config_hash")
    except (OSError, ValueError):
        return False
    # as train stores it: relative file paths made absolute
    return finished == config_hash(resolve_paths(copy.deepcopy(cfg)).to_dict())


def with_algorithm(cfg: TrainConfig, algo: str, keep: dict | None = None) -> TrainConfig:
    """``cfg`` under algorithm preset ``algo`` (a name of ``hacpo.engine.config``'s presets,
    ablations included), keeping its minibatch count (the run budget: a run preset tunes it)
    and ``keep``, dotted algorithm settings (``{"loss.alpha": 0.5}``: the user's own, see
    ``hacpo.launch.cli``), applied over the preset; shared by ``hacpo train --algorithm``,
    compare and profile. A kept setting that contradicts what makes ``algo`` that preset (e.g.
    ``loss.alpha=0.5`` for ``hacpo-alpha0``), or the algorithm's name, is an error: two
    algorithms of a comparison would otherwise silently be one."""
    import dataclasses
    keep = dict(keep or {})
    if "name" in keep:
        raise ValueError(f"algorithm.name={keep['name']!r} conflicts with the algorithm preset "
                         f"{algo!r}: choose the algorithm by its preset only")
    out = preset(algo, {"num_minibatches": cfg.algorithm.num_minibatches, **keep})
    own = preset(algo)
    for key in preset_settings(algo):
        if key in keep and dotted(out, key) != dotted(own, key):
            raise ValueError(f"algorithm.{key}={dotted(out, key)!r} contradicts the algorithm "
                             f"preset {algo!r}, which sets {key}={dotted(own, key)!r}: drop "
                             f"the setting or compare another preset")
    return dataclasses.replace(cfg, algorithm=out)


def dotted(obj, key: str):
    """``obj``'s attribute at the dotted path ``key`` (e.g. "loss.alpha")."""
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_run_list(command: str, what: str, xs) -> None:
    """``xs`` (``hacpo <command>``'s algorithms or seeds) names one run directory each: none is
    an error, and so is one given twice (a run counted twice: a false mean +- CI; measured
    once without a word)."""
    if not xs:
        raise ValueError(f"hacpo {command} needs at least one {what}")
    if twice := sorted({str(x) for x in xs if list(xs).count(x) > 1}):
        raise ValueError(f"{what} {', '.join(twice)} given more than once; each {what} is one "
                         f"run directory, list it once")


def render_table(results: dict, pass_k: int) -> str:
    agents = sorted({a for per in results.values() for a in per})
    keys = ("accuracy", f"pass@{pass_k}") if pass_k > 1 else ("accuracy",)  # 0/1: no pass@k
    lines = ["| algorithm | " + " | ".join(f"{a} avg@1" + (f" | {a} pass@{pass_k}"
                                                           if pass_k > 1 else "")
                                         for a in agents) + " | seeds |",
             "| --- |" + " --- |" * (len(keys) * len(agents)) + " --- |"]
    for algo, per in results.items():
        cells = []
        for a in agents:
            rows = per.get(a, [])
            for key in keys:
                xs = [100 * r[key] for r in rows if key in r]
                if xs:
                    m, ci = mean_ci(xs)
                    cells.append(f"{m:.1f} ± {ci:.1f}" if math.isfinite(ci) else f"{m:.1f}")
                else:
                    cells.append("–")
        n = max((len(v) for v in per.values()), default=0)
        lines.append(f"| {algo} | " + " | ".join(cells) + f" | {n} |")
    before = {a: statistics.fmean(r["before"] for per in results.values() for r in per.get(a, []))
              for a in agents}
    lines.append("")
    lines.append("Accuracy in % on the held-out set (greedy avg@1"
                 + ("; pass@k from k samples at the rollout temperature, unbiased estimator"
                    if pass_k > 1 else "")
                 + "); mean ± 95% CI (Student t) over seeds. Before RL (after the shared "
                 "warm-up): "
                 + ", ".join(f"{a} {100 * v:.1f}" for a, v in before.items()) + "."
                 + (" One seed: no interval (undefined), its mean alone."
                    if _one_seed(results) else ""))
    return "\n".join(lines) + "\n"


def _one_seed(results: dict) -> bool:
    """Has a cell of the table (or a bar of the plot) a single seed, so no 95% interval?"""
    return any(len(rows) == 1 for per in results.values() for rows in per.values())


def plot_compare(results: dict, path: str) -> None:
    import numpy as np
    agents = sorted({a for per in results.values() for a in per})
    algos = list(results)
    fig, ax = subplots(figsize=(1.6 * len(algos) + 3, 4))
    width = 0.8 / max(len(agents), 1)
    for j, a in enumerate(agents):
        ms, cis = [], []
        for algo in algos:
            xs = [100 * r["accuracy"] for r in results[algo].get(a, [])]
            m, ci = mean_ci(xs) if xs else (float("nan"), float("nan"))
            ms.append(m), cis.append(0 if not math.isfinite(ci) else ci)
        ax.bar(np.arange(len(algos)) + j * width, ms, width, yerr=cis, capsize=3, label=a)
    ax.set_xticks(np.arange(len(algos)) + width * (len(agents) - 1) / 2, algos)
    ax.set_ylabel("held-out greedy accuracy (%)"), ax.legend()
    ax.set_title("hacpo compare: mean ± 95% CI over seeds"
                 + (" (one seed: no interval)" if _one_seed(results) else ""))
    save_figure(fig, path)
