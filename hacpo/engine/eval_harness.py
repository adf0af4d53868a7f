"""`hacpo eval`: evaluate trained checkpoints on JSONL/parquet benchmarks.

Each checkpoint's policies are rebuilt exactly as its run built them (``build.rebuild_policies``
on the run's own config: a reduced vocabulary from the checkpoint's record of its tokens, or the
run's corpus for a checkpoint without one), then the saved weights are loaded. Every selected
agent answers every problem of every benchmark (``samples`` responses each), and the responses
are scored by the run's verifier (:class:`RewardComputer` with the run's reward name).

Reported per agent and benchmark: avg@k (mean reward over the k samples, averaged over problems)
with a 95% normal CI over problems (``1.96 * SE``; SE = population sd of the per-problem avg@k
over sqrt(n), which is the binomial ``sqrt(p(1-p)/n)`` when k = 1 and rewards are 0/1), and the
unbiased pass@k. The table's mean column is the unweighted mean over benchmarks (as the paper
reports); its CI combines the benchmark SEs (``sqrt(sum SE_b^2) / B``). With several runs the
table also has one row per agent name averaged over runs, with a Student-t CI over runs.

Problems a policy cannot take are scored 0 and counted, never fatal:

- a prompt with text the (reduced) vocabulary cannot encode strictly is re-encoded with the
  tokenizer's fallback (``<unk>`` for characters, byte pieces for byte-level BPE) and counted
  as ``fallback``; if no fallback exists it is ``unencodable`` and scores 0;
- a prompt too long for the policy (prompt + max_new_tokens > max_len) is ``too_long``, score 0.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import statistics
from typing import Callable, Optional, Sequence

from hacpo._stop import raise_lost_interrupt
from hacpo.models.tokenizer import UnencodableTextError

from . import build, checkpoint as ckpt
from .compare import mean_ci
from .data import FIELD_MAPS, DataError, apply_prompt_template, load_examples
from .evaluate import mean_and_stderr, pass_at_k, sample_and_score
from .errors import StorageError
from .rewards import RewardComputer
from .run_config import TrainConfig, drop_unused_policy_settings

__all__ = ["Benchmark", "parse_benchmark_spec", "resolve_checkpoint", "prompt_ids_lenient",
           "evaluate_checkpoints", "eval_config", "FIELD_MAP_NAMES"]

CHECKPOINT = "checkpoint.pt"
EVAL_LOCK = ".hacpo-eval.lock"     # held in each output folder while an evaluation writes it
FIELD_MAP_NAMES = ("auto", *FIELD_MAPS)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    path: str
    field_map: str = "auto"   # one of FIELD_MAP_NAMES


def parse_benchmark_spec(spec: str) -> Benchmark:
    """``NAME=PATH[:FIELDMAP]`` -> :class:`Benchmark` (FIELDMAP: auto, gsm8k, math,
    math_answer, question_answer; default auto). ValueError on a malformed spec."""
    usage = f"malformed benchmark spec {spec!r}: expected NAME=PATH[:FIELDMAP] with FIELDMAP " \
            f"one of {', '.join(FIELD_MAP_NAMES)}"
    if "=" not in spec:
        raise ValueError(usage)
    name, rest = spec.split("=", 1)
    name = name.strip()
    if not name or not _NAME_RE.match(name):
        raise ValueError(f"{usage} (NAME must be ASCII letters, digits, '_', '.', '+', '-')")
    path, fm = rest, "auto"
    if ":" in rest:
        head, tail = rest.rsplit(":", 1)
        if tail in FIELD_MAP_NAMES:
            path, fm = head, tail
        elif "/" not in tail and "." not in tail and not os.path.exists(rest):
            raise ValueError(f"{usage} (unknown field map {tail!r})")
    if not path:
        raise ValueError(f"{usage} (empty PATH)")
    return Benchmark(name, os.path.expanduser(path), fm)     # (a shell leaves NAME=~/x)


def _not_a_file(ck: str) -> None:
    """Raise what ``ck`` (there, but no checkpoint file) is: never "no checkpoint saved"."""
    if os.path.isdir(ck):
        raise IsADirectoryError(f"checkpoint {ck} is a directory, not a checkpoint file")
    if os.path.islink(ck) and not os.path.exists(ck):
        raise FileNotFoundError(f"{ck} is a symbolic link to {os.readlink(ck)}, which does "
                                f"not exist: restore its target")
    raise FileNotFoundError(f"checkpoint {ck} is not a regular file")


def resolve_checkpoint(path: str) -> tuple[str, str]:
    """A run dir or a checkpoint file -> (checkpoint path, run dir). FileNotFoundError if none."""
    path = os.fspath(path)     # a pathlib.Path: recorded in eval.json, which writes no Path
    if os.path.isdir(path):
        ck = os.path.join(path, CHECKPOINT)
        if os.path.lexists(ck) and not os.path.isfile(ck):
            _not_a_file(ck)
        if not os.path.isfile(ck):
            raise FileNotFoundError(f"run dir {path} holds no {CHECKPOINT} (did the run save one?)")
        return ck, os.path.abspath(path)
    if os.path.isfile(path):
        return path, os.path.dirname(os.path.abspath(path))
    if os.path.islink(path):
        _not_a_file(path)
    raise FileNotFoundError(f"no checkpoint at {path} (pass a run dir or a {CHECKPOINT} path)")


def prompt_ids_lenient(tok, question: str) -> tuple[Optional[list[int]], str]:
    """``tok.prompt_ids`` strictly; else with the tokenizer's fallback encoding.
    Returns (ids, "ok" | "fallback") or (None, "unencodable") when no fallback exists."""
    try:
        return tok.prompt_ids(question), "ok"
    except UnencodableTextError:
        pass
    try:
        return tok.prompt_ids(question, errors="fallback"), "fallback"
    except UnencodableTextError:
        pass
    return None, "unencodable"


# --------------------------------------------------------------------------------------------
# Scoring one policy on one benchmark
# --------------------------------------------------------------------------------------------

def _score_policy(policy, questions: list[str], golds: list[str], rc: RewardComputer, *,
                  samples: int, temperature: float, top_p: float, max_new_tokens: int,
                  batch: int, seed: int, bench: str) -> tuple[list[dict], dict]:
    tok = policy.tokenizer
    per: list[dict] = []
    todo: list[int] = []
    ids: list[list[int]] = []
    counts = {"ok": 0, "fallback": 0, "unencodable": 0, "too_long": 0}
    for i, q in enumerate(questions):
        p, status = prompt_ids_lenient(tok, q)
        if p is not None and len(p) + max_new_tokens > policy.max_len:
            status = "too_long"
        counts[status] += 1
        per.append({"status": status, "rewards": [0.0] * samples, "responses": []})
        if status in ("ok", "fallback"):
            todo.append(i)
            ids.append(p)
    rewards, texts, extra = sample_and_score(
        policy, ids, [golds[i] for i in todo], rc, max_new_tokens=max_new_tokens,
        samples=samples, temperature=temperature, top_p=top_p, batch=batch, seed=seed,
        where=lambda j: f"benchmark {bench}, problem {todo[j]}")
    for i, r, t in zip(todo, rewards, texts):
        per[i]["rewards"], per[i]["responses"] = r, t
    return per, {**counts, **extra}


def _summary(per: list[dict], samples: int) -> dict:
    n = len(per)
    m, se = mean_and_stderr([sum(p["rewards"]) / samples for p in per])
    correct = [sum(r > 0.5 for r in p["rewards"]) for p in per]
    return {"n": n, f"avg@{samples}": m, "stderr": se, "ci95": 1.96 * se,
            f"pass@{samples}": sum(pass_at_k(samples, c, samples) for c in correct) / n}


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

# What `hacpo eval` reads of a run's stored config: every agent's policy, the data (the
# default template; a reduced vocabulary the checkpoint does not record is built from the
# run's corpus), the reward, the torch
# thread count, the run's seed (its evaluation's sampling seed: the default of --seed), and
# (where no option replaces them) the rollout temperature and top-p (when sampling) and the
# response-length limits. The rest (rollout engine, trainer, parallel
# layout, optimizer, timeouts, ...) builds no part of the evaluated model: an old checkpoint
# whose stored values this version refuses there (or whose keys it no longer knows) still
# evaluates.
_EVAL_TOP_KEYS = ("data", "reward", "threads", "seed")


def eval_config(stored: dict, *, temperature: bool = True, max_new_tokens: bool = True,
                top_p: bool = True, where: str = "the run") -> tuple[TrainConfig, list[str]]:
    """The TrainConfig `hacpo eval` rebuilds the run's policies from: ``stored`` (a
    checkpoint's config dict) cut to what evaluation reads (above), everything else at its
    default. ``temperature`` / ``max_new_tokens`` / ``top_p``: whether the stored rollout
    temperature / response-length limits / top-p are used (no option replaces them). Returns
    the config and the stored policy settings left out because the run's build never used
    them (notes).

    A value evaluation does read that this version refuses is a ValueError naming the key."""
    if not isinstance(stored, dict) or not isinstance(stored.get("agents"), list):
        raise ValueError(f"cannot evaluate {where}: its stored config holds no list of agents")
    d = {k: stored[k] for k in _EVAL_TOP_KEYS if k in stored}
    roll = stored.get("rollout") if isinstance(stored.get("rollout"), dict) else {}
    keep = (["temperature"] if temperature else []) + (["max_new_tokens"] if max_new_tokens
                                                       else []) + (["top_p"] if top_p else [])
    d["rollout"] = {k: roll[k] for k in keep if k in roll}
    if max_new_tokens and "eval_max_new_tokens" in stored:
        d["eval_max_new_tokens"] = stored["eval_max_new_tokens"]
    notes, agents = [], []
    for i, a in enumerate(stored["agents"]):
        pol = a.get("policy") if isinstance(a, dict) else None
        if isinstance(pol, dict):
            pol = copy.deepcopy(pol)        # the state stays as loaded
            notes += [f"agents.{i} ({pol.get('name')!r}): {x}"
                      for x in drop_unused_policy_settings(pol)]
            agents.append({"policy": pol})
        else:
            agents.append(a)     # not a mapping: from_dict's error names it
    d["agents"] = agents
    try:
        return TrainConfig.from_dict(d), notes
    except ValueError as e:
        hint = "".join(f" (or give {opt})" for key, opt in (
            ("rollout.temperature", "--temperature"), ("max_new_tokens", "--max-new-tokens"),
            ("rollout.top_p", "--top-p"))
            if key in str(e))
        raise ValueError(f"cannot evaluate {where}: its stored config: {e}{hint}") from None


def _load_run(path: str, moved: Optional[dict] = None, **need):
    """A run's checkpoint and the config `hacpo eval` / `export` rebuild its policies from,
    with the folders ``moved`` names at their new place (build.moved_config)."""
    ck_path, run_dir = resolve_checkpoint(path)
    state = ckpt.load(ck_path)
    if not isinstance(state, dict) or "config" not in state or "agents" not in state:
        raise ValueError(f"{ck_path} is not a hacpo training checkpoint (no 'config'/'agents')")
    stored = build.moved_config(state, moved, ck_path) if moved else state["config"]
    cfg, notes = eval_config(stored, where=ck_path, **need)
    return ck_path, run_dir, state, cfg, notes


def _sampled_elsewhere(stored: dict) -> Optional[str]:
    """The rollout engine a run's own sampled evaluation (eval_pass_k) drew its samples with
    when `hacpo eval` cannot draw the same ones in-process (eval_engine=rollout with vLLM, or
    with several engines per agent, each with its own generator); else None."""
    roll = stored.get("rollout") if isinstance(stored.get("rollout"), dict) else {}
    if stored.get("eval_engine") != "rollout":
        return None
    if roll.get("engine") == "vllm":
        return "its vLLM engines"
    if roll.get("engine") == "ray" and (roll.get("engines_per_agent") or 1) > 1:
        return f"{roll['engines_per_agent']} Ray rollout engines per agent"
    return None


def _labels(run_dirs: list[str]) -> list[str]:
    """One label per run: its folder's name, ``name#i`` where names repeat, and unique in
    every case (a run folder itself named ``r1#1`` must not merge with the second ``r1``)."""
    base = [os.path.basename(d.rstrip(os.sep)) or "run" for d in run_dirs]
    labels: list[str] = []
    for i, b in enumerate(base):
        label = b if base.count(b) == 1 else f"{b}#{i}"
        while label in labels or label in base[i + 1:]:
            label = f"{label}#{i}"
        labels.append(label)
    return labels


@build.keeps_torch_threads
def evaluate_checkpoints(checkpoints: Sequence[str], benchmarks: Sequence, *,
                         agents: Optional[Sequence[str]] = None, samples: int = 1,
                         temperature: Optional[float] = None, top_p: Optional[float] = None,
                         max_new_tokens: Optional[int] = None, limit: Optional[int] = None,
                         template: Optional[str] = None, out_dir: Optional[str] = None,
                         batch: int = 128, seed: Optional[int] = None,
                         moved: Optional[dict] = None,
                         echo: Callable[[str], None] = print) -> dict:
    """Evaluate ``agents`` (default: all) of each checkpoint (run dir or ``checkpoint.pt``) on
    each benchmark (:class:`Benchmark` or ``NAME=PATH[:FIELDMAP]`` string).

    temperature: default 0 (greedy) when samples == 1, else the run's rollout temperature.
    top_p: default the run's rollout top-p when sampling (as the run's own pass@k does), else 1.
    max_new_tokens: default the run's eval_max_new_tokens, else rollout.max_new_tokens.
    template: prompt template name; default the run's data.template.
    batch, seed: prompts per generation batch (default 128) and the sampling seed of the first
    benchmark (the i-th gets seed + 1000 i); the seed defaults to the one the run's own
    evaluation used (its seed, and seed + 1 for its sampled pass@k), so the defaults draw the
    very samples of the run's eval_pass_k on its own held-out set (where the run sampled them
    in-process too: not with eval_engine=rollout on vLLM or several engines per agent, which
    a note then says).
    moved: ``{"agents.N.policy.path" | "agents.N.policy.tokenizer": new place}`` of each run's
    model or tokenizer folders moved since it ran, checked to hold what its checkpoint records.
    Writes ``<agent>__<benchmark>.json`` per agent and benchmark and ``eval.md``/``eval.json``
    (the table) to ``out_dir`` (default ``<run dir>/eval``; with several runs and an explicit
    out_dir, per-run files go to ``out_dir/<run>``). Each folder written is locked meanwhile
    (``.hacpo-eval.lock``): one another evaluation writes is a RuntimeError naming its holder.
    Returns the ``eval.json`` content plus ``"table"`` (markdown) and ``"out_dirs"``.
    A single checkpoint, benchmark or agent name may be given alone (not in a list).
    """
    # one given alone: a string iterated was its characters ("run dir / holds no
    # checkpoint.pt", "malformed benchmark spec 'g'", "unknown agent(s) ['c', 'h', ...]")
    checkpoints, benchmarks, agents = (
        [x] if isinstance(x, (str, os.PathLike, Benchmark)) else x
        for x in (checkpoints, benchmarks, agents))
    if not checkpoints:
        raise ValueError("no checkpoint given")
    if not benchmarks:
        raise ValueError("no benchmark given")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature is not None and not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    benches = [dataclasses.replace(b, path=os.fspath(b.path)) if isinstance(b, Benchmark)
               else parse_benchmark_spec(b) for b in benchmarks]
    names = [b.name for b in benches]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark names must be unique, got {names}")
    for b in benches:
        if b.field_map not in FIELD_MAP_NAMES:
            raise ValueError(f"benchmark {b.name}: unknown field map {b.field_map!r}; one of "
                             f"{', '.join(FIELD_MAP_NAMES)}")
        if not os.path.isfile(b.path):
            raise FileNotFoundError(f"benchmark {b.name}: no file at {b.path}")
    if template is not None:
        apply_prompt_template(template, "")   # KeyError listing the known templates
    # fail fast on a bad path or config before any work
    sampled = temperature > 0 if temperature is not None else samples > 1
    runs = [_load_run(c, moved, temperature=temperature is None and samples > 1,
                      max_new_tokens=max_new_tokens is None, top_p=top_p is None and sampled)
            for c in checkpoints]
    for ck_path, _, state, _, notes in runs:
        for n in notes:
            echo(f"[eval] {ck_path}: ignoring {n} (the run's policy build never used it)")
        if sampled and (engine := _sampled_elsewhere(state["config"])):
            echo(f"[eval] {ck_path}: note: the run sampled its own evaluation with {engine}; "
                 f"hacpo eval samples in-process: the same distribution, not the same samples")
        have = [a["name"] for a in state["agents"]]
        missing = [a for a in (agents or []) if a not in have]
        if missing:
            raise ValueError(f"unknown agent(s) {missing} in {ck_path}; it holds {have}")
    loaded = {}
    for b in benches:
        fm = "auto" if b.field_map == "auto" else FIELD_MAPS[b.field_map]
        try:
            exs, _ = load_examples(b.path, fm, source=b.name, limit=limit)
        except DataError as e:
            raise DataError(f"benchmark {b.name}: {e}") from None
        if not exs:
            raise DataError(f"benchmark {b.name}: {b.path} holds no problems")
        loaded[b.name] = exs
    labels = _labels([r[1] for r in runs])
    out_dirs = [os.path.join(run[1], "eval") if out_dir is None else
                os.path.join(out_dir, label) if len(runs) > 1 else out_dir
                for run, label in zip(runs, labels)]
    first: dict[str, int] = {}      # two checkpoints of one run dir (or one run under two
    for i, d in enumerate(out_dirs):  # names): the second's per-pair files replaced the first's
        j = first.setdefault(os.path.realpath(d), i)
        if j != i:
            raise ValueError(f"{runs[j][0]} and {runs[i][0]} would both write {d}: pass "
                             f"--out-dir (a folder per run under it), or give each once")
    # every output dir made (and writable) before any policy is scored: a run dir on a
    # read-only mount, or a file in the way, is an error now, not after the evaluation
    made: dict[str, str | None] = {}     # each output dir -> the folder ensure_dir made
    try:
        # (the locks are released, and their files removed, before the folders made go)
        with contextlib.ExitStack() as held:
            for d in dict.fromkeys(([out_dir] if out_dir is not None else []) + out_dirs):
                made[d] = ckpt.first_missing(d)
                try:
                    ckpt.ensure_dir(d, "eval output dir")
                except OSError as e:
                    raise StorageError.like(e, f"{e} (--out-dir chooses another)", d) from None
                held.enter_context(_locked(d))
            return _evaluate(runs, labels, out_dirs, out_dir, benches, loaded, names,
                             agents=agents, template=template, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, samples=samples, seed=seed,
                             batch=batch, limit=limit, echo=echo)
    except BaseException:      # failed or stopped: the folders it made and left empty go
        for d in reversed(list(made)):
            ckpt.remove_made_dirs(d, made[d])
        raise


@contextlib.contextmanager
def _locked(d: str):
    """Hold ``<d>/.hacpo-eval.lock`` (the kind of lock a run holds on its run dir) while this
    evaluation writes ``d``: two evaluations into one folder at once wrote an eval.md of
    per-pair files the other had replaced. Its file is removed as the evaluation ends, while
    still held (a waiting evaluation then takes a new one), so it is never among the outputs."""
    from .trainer import lock_dir      # (not at the top: the trainer imports the whole engine)
    lock = lock_dir(d, EVAL_LOCK, "evaluation", "choose another --out-dir")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(d, EVAL_LOCK))
        lock.close()


def _evaluate(runs, labels, out_dirs, out_dir, benches, loaded, names, *, agents, template,
              max_new_tokens, temperature, top_p, samples, seed, batch, limit, echo):
    """evaluate_checkpoints' scoring and writing, once its output dirs exist."""
    targets = [out_dir] if out_dir is not None else out_dirs    # where eval.md / eval.json go
    # every folder this evaluation writes: with several runs and an out_dir, the per-pair files
    # go to out_dir/<run>, where an earlier evaluation of that run alone left its summary
    folders = list(dict.fromkeys(targets + out_dirs))

    def summary_at(d):
        return "written again when this one finishes" if d in targets else \
            f"this one's are written to {out_dir}"

    def drop_stale_summaries():
        # an earlier evaluation's summary: this one's per-pair files replace that one's as they
        # are scored, so a stopped evaluation left a summary of files it no longer described;
        # it is rewritten when this one finishes. Removed as the first per-pair file is
        # written, not before: an error before any (a --max-new-tokens too large for an
        # agent, a moved model folder) removed it and wrote no other
        for d in folders:
            stale = [f for f in ("eval.md", "eval.json") if os.path.isfile(os.path.join(d, f))]
            for f in stale:
                os.unlink(os.path.join(d, f))
            if stale:
                echo(f"[eval] {d}: removed {' and '.join(stale)} of an earlier evaluation "
                     f"({summary_at(d)})")
    results: list[dict] = []
    written: set[str] = set()
    for (ck_path, run_dir, state, cfg, _), label, rdir in zip(runs, labels, out_dirs):
        tmpl = template or cfg.data.template
        max_new = (max_new_tokens if max_new_tokens is not None else
                   cfg.eval_max_new_tokens or cfg.rollout.max_new_tokens)
        temp = temperature if temperature is not None else \
            (0.0 if samples == 1 else cfg.rollout.temperature)
        tp = top_p if top_p is not None else cfg.rollout.top_p   # 1.0 unless read (sampled)
        seed0 = seed if seed is not None else cfg.seed + (1 if temp > 0 else 0)
        saved = {a["name"]: a for a in state["agents"]}
        chosen = list(dict.fromkeys(agents)) if agents else [a["name"] for a in state["agents"]]
        echo(f"[eval] {label}: rebuilding {len(chosen)} polic{'y' if len(chosen) == 1 else 'ies'}"
             f" from {ck_path} ({_step(state.get('step'))})")   # a live run's: which one
        policies = {p.name: p for p in build.rebuild_policies(
            cfg, state, chosen, f"cannot evaluate {ck_path}")}
        for name in chosen:     # no prompt of even one token would fit: every problem a 0
            if max_new >= policies[name].max_len:
                raise ValueError(f"max_new_tokens {max_new} leaves no room for a prompt in agent "
                                 f"{name!r}'s context of {policies[name].max_len} tokens "
                                 f"(--max-new-tokens chooses fewer)")
        if bad := build.tokenizer_mismatch(state, [policies[name] for name in chosen], cfg):
            raise ValueError(f"cannot evaluate {ck_path}: {bad}")
        # not an error (a resume's is): an evaluation chooses its prompts (--template), and
        # one after a tokenizer upgrade is a fair question; its numbers are of prompts of now
        if note := build.encoding_mismatch(state, [policies[name] for name in chosen]):
            echo(f"[eval] note: {note}; it is evaluated on prompts encoded as now")
        with RewardComputer(cfg.reward.name, num_workers=cfg.reward.num_workers,
                            timeout_s=cfg.reward.timeout_s) as rc:
            for name in chosen:
                pol = policies[name]
                try:
                    pol.load_state_dict(saved[name]["model"])
                except RuntimeError as e:    # other shapes: e.g. a checkpoint without tokenizers
                    raise ValueError(f"cannot evaluate {ck_path}: agent {name}'s weights do not "
                                     f"fit its policy rebuilt from the run's config "
                                     f"({build.vocab_source(cfg)}): {e}") from None
                for bi, b in enumerate(benches):
                    raise_lost_interrupt()   # a Ctrl-C Python dropped: the stop, before a pair
                    exs = loaded[b.name]
                    qs = [apply_prompt_template(tmpl, e.prompt) for e in exs]
                    per, counts = _score_policy(
                        pol, qs, [e.answer for e in exs], rc, samples=samples,
                        temperature=temp, top_p=tp, max_new_tokens=max_new, batch=batch,
                        seed=seed0 + 1000 * bi, bench=b.name)
                    for e, p in zip(exs, per):
                        p["id"], p["gold"] = e.id, e.answer
                    rec = {"run": label, "run_dir": run_dir, "checkpoint": ck_path,
                           "step": state.get("step"), "agent": name,
                           "tokenizer": pol.tokenizer.name, "benchmark": b.name,
                           "path": b.path, "field_map": b.field_map, "samples": samples,
                           "temperature": temp, "top_p": tp, "max_new_tokens": max_new,
                           "template": tmpl, "reward": cfg.reward.name, "limit": limit,
                           "batch": batch,
                           "seed": seed0 + 1000 * bi, **_summary(per, samples), **counts,
                           "problems": [{k: p[k] for k in ("id", "gold", "status", "rewards",
                                                          "responses")} for p in per]}
                    if not written:
                        drop_stale_summaries()
                    ckpt.write_text_atomic(os.path.join(rdir, f"{name}__{b.name}.json"),
                                           json.dumps(rec, indent=1))
                    written.add(os.path.join(rdir, f"{name}__{b.name}.json"))
                    echo(f"[eval] {label}/{name} {b.name}: avg@{samples} "
                         f"{rec[f'avg@{samples}']:.3f} ± {rec['ci95']:.3f} (95% CI, "
                         f"n={rec['n']})")
                    # its responses are in its file: not held until every pair is scored
                    results.append({k: v for k, v in rec.items() if k != "problems"})
    report = _report(results, names, samples, multi=len(runs) > 1)
    table = _markdown(report, names, samples)
    for d in dict.fromkeys(targets):
        ckpt.write_text_atomic(os.path.join(d, "eval.md"), table)
        ckpt.write_text_atomic(os.path.join(d, "eval.json"), json.dumps(report, indent=1))
    for d in folders:
        # per-pair files of an earlier evaluation into the same folder are kept (results), but
        # said: eval.md / eval.json are this evaluation's only
        older = sorted(f for f in os.listdir(d) if f.endswith(".json") and "__" in f
                       and os.path.join(d, f) not in written)
        if older:
            echo(f"[eval] {d} also holds {len(older)} file(s) of an earlier evaluation "
                 f"({', '.join(older[:4])}{', ...' if len(older) > 4 else ''}): kept; "
                 + ("eval.md and eval.json are this evaluation's" if d in targets else
                    f"this evaluation's eval.md and eval.json are in {out_dir}"))
    return {**report, "table": table, "out_dirs": list(dict.fromkeys(targets))}


def _step(step) -> str:
    """A checkpoint's step as the console and eval.md say it."""
    return "step unknown" if step is None else f"step {step}"


def _report(results: list[dict], benches: list[str], samples: int, multi: bool) -> dict:
    avg, pk = f"avg@{samples}", f"pass@{samples}"
    rows: list[dict] = []
    keyed: dict[tuple[str, str], dict[str, dict]] = {}
    for r in results:
        keyed.setdefault((r["run"], r["agent"]), {})[r["benchmark"]] = r
    for (run, agent), by in keyed.items():
        cells = {b: {avg: by[b][avg], "ci95": by[b]["ci95"], pk: by[b][pk]} for b in benches}
        ses = [by[b]["stderr"] for b in benches]
        mean = {avg: statistics.fmean(c[avg] for c in cells.values()),
                "ci95": 1.96 * math.sqrt(sum(s * s for s in ses)) / len(ses),
                pk: statistics.fmean(c[pk] for c in cells.values())}
        rows.append({"row": f"{run}/{agent}" if multi else agent, "run": run, "agent": agent,
                     "ci": "normal", "reward": by[benches[0]]["reward"],
                     "benchmarks": cells, "mean": mean,
                     "fallback": sum(by[b]["fallback"] for b in benches),
                     "unencodable": sum(by[b]["unencodable"] for b in benches),
                     "too_long": sum(by[b]["too_long"] for b in benches),
                     "problems": sum(by[b]["n"] for b in benches)})
    notes = []
    if multi:   # per agent name over runs: Student t CI over the runs' values
        agents = list(dict.fromkeys(r["agent"] for r in rows))
        for a in agents:
            mine = [r for r in rows if r["agent"] == a and r["ci"] == "normal"]
            if len(mine) < 2:
                continue
            if len(rewards := list(dict.fromkeys(r["reward"] for r in mine))) > 1:
                # each run is scored by its own reward: a mean of different measures
                notes.append(f"No '{a} (mean of {len(mine)} runs)' row: its runs are scored "
                             f"by different rewards ({', '.join(rewards)}).")
                continue
            cells = {}
            for b in benches:
                m, h = mean_ci([r["benchmarks"][b][avg] for r in mine])
                cells[b] = {avg: m, "ci95": h,
                            pk: statistics.fmean(r["benchmarks"][b][pk] for r in mine)}
            m, h = mean_ci([r["mean"][avg] for r in mine])
            rows.append({"row": f"{a} (mean of {len(mine)} runs)", "run": None, "agent": a,
                         "ci": "t", "reward": rewards[0], "benchmarks": cells,
                         "mean": {avg: m, "ci95": h,
                                  pk: statistics.fmean(r["mean"][pk] for r in mine)},
                         **{k: sum(r[k] for r in mine)
                            for k in ("fallback", "unencodable", "too_long", "problems")}})
    return {"samples": samples, "metric": avg, "benchmarks": benches, "rows": rows,
            "notes": notes, "results": results}


def _markdown(report: dict, benches: list[str], samples: int) -> str:
    avg, pk = f"avg@{samples}", f"pass@{samples}"
    head = "| agent | " + " | ".join(benches) + " | mean |\n"
    sep = "|---|" + "---:|" * (len(benches) + 1) + "\n"

    def cell(c, key, ci=True):
        return f"{100 * c[key]:.1f}" + (f" ± {100 * c['ci95']:.1f}" if ci else "")

    # which checkpoint of each run was scored (a live run's changes as it trains)
    cks = list(dict.fromkeys((r["run"], r["checkpoint"], r["step"])
                             for r in report.get("results", [])))
    out = ""
    if len(cks) == 1:
        out = f"Checkpoint: {cks[0][1]} ({_step(cks[0][2])})\n\n"
    elif cks:
        out = "Checkpoints:\n\n" + "".join(f"- {run}: {ck} ({_step(step)})\n"
                                              for run, ck, step in cks) + "\n"
    out += f"{avg} (%), 95% CI\n\n" + head + sep
    for r in report["rows"]:
        out += f"| {r['row']} | " + " | ".join(cell(r["benchmarks"][b], avg) for b in benches) \
            + f" | {cell(r['mean'], avg)} |\n"
    if samples > 1:
        out += f"\n{pk} (%, unbiased estimator)\n\n" + head + sep
        for r in report["rows"]:
            out += f"| {r['row']} | " + " | ".join(cell(r["benchmarks"][b], pk, False)
                                                  for b in benches) \
                + f" | {cell(r['mean'], pk, False)} |\n"
    unenc = sum(r["unencodable"] for r in report["rows"] if r["ci"] == "normal")
    fb = sum(r["fallback"] for r in report["rows"] if r["ci"] == "normal")
    tl = sum(r["too_long"] for r in report["rows"] if r["ci"] == "normal")
    out += (f"\nCI: ± 1.96·SE, normal approximation over problems (binomial for k=1 with 0/1 "
            f"rewards), SE = sd of the per-problem {avg} / √n; the mean column is the unweighted "
            "mean over benchmarks, its SE = √(Σ SE_b²) / B.")
    if any(r["ci"] == "t" for r in report["rows"]):
        out += " Rows '(mean of N runs)': mean over runs with a Student-t 95% CI over runs."
    for note in report["notes"]:
        out += " " + note
    out += (f"\nPrompts encoded with the tokenizer fallback: {fb}; unencodable prompts (scored "
            f"0): {unenc}; prompts too long for the policy (scored 0): {tl}.\n")
    return out
