"""hacpo train — the paper's Algorithm 1 for n >= 2 heterogeneous agents, every algorithm of
SPEC through one code path.

    for step t = 0 .. T-1:
        prompts    <- sampler.next_batch(B)                        data.py
        rollouts   <- each agent k samples G responses per prompt  rollout.py
        rewards    <- shared verifier on all n*B*G responses       rewards.py
        Phat       <- capability tracker update (includes step t)  capability.py
        lp_old     <- each generator's own forward pass            pool.py
        for each learner k:
            idx, A <- its samples and advantages                   algorithm.py
            view   <- cross samples re-tokenized for k             pool.py
            M minibatch updates, stepwise index m                  update.py
        metrics, checkpoint                                        metrics.py, checkpoint.py

Each agent's policy, optimizer and reference policy live in an agent group (agents.py):
in-process (trainer_backend=local) or one Ray actor per agent (ray, launch/ray_trainer.py).
"""
from __future__ import annotations

import contextlib
import copy
import errno
import importlib
import json
import logging
import os
import shlex
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from hacpo.models.retokenize import RetokStats
from hacpo.models.tokenizer import UnencodableTextError, batches

from . import build, checkpoint as ckpt
from .agents import build_agents, score_temperature, update_agents
from .algorithm import learner_samples, sample_omega
from .capability import CapabilityTracker
from .data import PromptSampler, content_digest
from .errors import (StorageError, describe_os_error, missing_package, require_installed,
                     user_errors)
from .evaluate import evaluate_policy, score_named
from .metrics import MetricsLogger, amend_row
from .plots import PLOT_FILES, RATIO_EDGES, RATIO_FILE, ratio_counts
from .pool import build_pool, learner_view
from .rewards import RewardComputer
from .rollout import generate_agents, sync_agents
from .run_config import (TrainConfig, accepted_encoding_agents, check_new_run_names,
                         config_diff, config_hash, default_fingerprint,
                         drop_unused_policy_settings, fingerprint_dict, resolve_paths,
                         resolve_stored_paths, revalidated, unused_rollout_settings)
# request_stop: the API's way to stop a run at a checkpoint (hacpo.engine.signals)
from .signals import (RunStopped, clear_stop_request, raise_lost_interrupt,  # noqa: F401
                      request_stop, stop_requested)
from .timing import Stopwatch, device_sync, null_timer

CHECKPOINT = "checkpoint.pt"
UPDATE_STAGES = ("score_prompt", "score_self", "score_cross", "backward_prompt", "backward_self",
                 "backward_cross", "optimizer")


def score_batch(rc: RewardComputer, pool, golds: list[str], names: list[str]):
    """Rewards [N] float32 from the shared verifier; a bad reward names the prompt and agent."""
    rewards, stats = score_named(rc, pool.texts, [golds[int(p)] for p in pool.prompt],
                                 lambda i: f"prompt {int(pool.prompt[i])}, "
                                           f"agent {names[int(pool.agent[i])]}")
    return torch.tensor(rewards, dtype=torch.float32), stats


def evaluate_all(cfg, data, agents, engine, rc, pass_k: int = 0) -> dict[str, dict]:
    """Greedy avg@1 per agent on the held-out set; with pass_k > 1 also avg@k and pass@k of
    k samples at the rollout temperature. ``eval_engine = "trainer"``: sampled by the
    trainer's policies (``agents.evaluate``); ``"rollout"``: by the rollout ``engine`` (the
    weights it holds: the last synced, i.e. the trainer's; e.g. vLLM instead of a CPU copy),
    whose RNG state is restored afterwards, so evaluation never changes the training
    rollouts."""
    golds = [e.answer for e in data.eval]
    max_new = cfg.eval_max_new_tokens or cfg.rollout.max_new_tokens
    prompts = [[p.tokenizer.prompt_ids(build.prompt_text(cfg, e)) for e in data.eval]
               for p in agents.policies]

    def evaluate(**kw):
        if cfg.eval_engine == "trainer":
            return agents.evaluate(prompts, golds, rc, **kw)
        saved = engine.state_dict()
        try:
            return [evaluate_policy(p, prompts[k], golds, rc, engine=engine, agent=k, **kw)
                    for k, p in enumerate(agents.policies)]
        finally:
            engine.load_state_dict(saved)

    out = evaluate(max_new_tokens=max_new, seed=cfg.seed)
    if pass_k > 1:
        sampled = evaluate(max_new_tokens=max_new, samples=pass_k,
                           temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                           seed=cfg.seed + 1)
        for r, s in zip(out, sampled):
            r[f"avg@{pass_k}"] = s["accuracy"]
            r[f"pass@{pass_k}"] = s[f"pass@{pass_k}"]
    return dict(zip(agents.names, out))


@build.keeps_torch_threads
def train(cfg: TrainConfig, *, resume: bool = False,
          accept_encoding_change: bool | Sequence[str] = False, echo=print) -> dict:
    """Run (or resume) training; returns the summary (held-out accuracy before/after). The
    run dir is locked for the whole run: a second run in it (or a resume while the first
    still runs) is an error, never two writers of one metrics.jsonl and checkpoint.

    A resume whose agent's tokenizer encodes prompts otherwise than at the checkpoint (an
    edited chat template, a tokenizers upgrade) is refused unless ``accept_encoding_change``
    (True: every agent's; agent names: those agents'): then it goes on with the tokenizer as
    it is now, says so, and the checkpoints record the step and agent of each change accepted
    (``encoding_changes``)."""
    with user_errors():
        cfg = revalidated(cfg)             # a copy; checked again if edited in place
        accept_encoding_change = accepted_encoding_agents(
            accept_encoding_change, [a.policy.name for a in cfg.agents])
        if accept_encoding_change and not resume:
            raise ValueError("accept_encoding_change (--accept-encoding-change) applies to a "
                             "resume only (--resume): a new run has no encoding to change")
        cfg.check_runnable()               # before the warm-up, not at the engines' start
        for note in check_packages(cfg):   # ray (before megatron_trainer imports it), and
            echo(f"[warn] {note}")         # the default-on features' packages
        check_private_cluster(cfg)
        if any(a.trainer == "megatron" for a in cfg.agents):   # the setup hook and TE: here,
            from hacpo.launch.megatron_trainer import check_driver_setup   # not in every rank
            check_driver_setup(cfg)
        cfg = resolve_paths(cfg)           # files by absolute path (config.json)
        made = ckpt.first_missing(cfg.out_dir)    # the folder lock_run_dir creates, if any
        lock_path = os.path.join(cfg.out_dir, RUN_LOCK)
        new_lock = not os.path.lexists(lock_path)
        try:
            lock = lock_run_dir(cfg.out_dir)
        except OSError:     # (not "in use": that lock file is the other run's) e.g. a full
            if new_lock:    # disk: a new run leaves nothing it made
                with contextlib.suppress(OSError):
                    os.unlink(lock_path)
                ckpt.remove_made_dirs(cfg.out_dir, made)
            raise
    try:
        with RewardComputer(cfg.reward.name, num_workers=cfg.reward.num_workers,
                            timeout_s=cfg.reward.timeout_s) as rc:   # no worker outlives the run
            with user_errors(ValueError):
                rc.start()           # a reward its workers cannot load: before any work
            return _train(cfg, rc, resume, accept_encoding_change, echo)
    except BaseException:
        # a new run refused before its config.json (an agent name new runs may not use, a
        # missing data file) leaves nothing it made: its lock file, and the folders it made
        # if they hold nothing else; a run dir that existed keeps what it held (a model
        # folder refused as one: its config.json is not a run's)
        if new_lock and not _run_config_held(cfg.out_dir):
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
            ckpt.remove_made_dirs(cfg.out_dir, made)
        raise
    finally:
        lock.close()


RUN_LOCK = ".hacpo-run.lock"
RUN_LOCK_WAIT_ENV = "HACPO_RUN_LOCK_WAIT_S"   # how long a lock held from another host is waited


def lock_run_dir(out_dir: str):
    """Create ``out_dir`` if needed and take an exclusive lock on ``<out_dir>/.hacpo-run.lock``:
    :func:`lock_dir` for a run."""
    # a file, a dangling link, a read-only parent, no permission: one line naming it
    ckpt.ensure_dir(out_dir, "run dir (out_dir)")
    return lock_dir(out_dir, RUN_LOCK, "run", "choose another out_dir")


def lock_dir(out_dir: str, name: str, user: str, other: str):
    """Take an exclusive lock on ``<out_dir>/<name>`` for a hacpo ``user`` ("run",
    "evaluation"; ``other``: what else the user may do, "choose another out_dir")
    (a POSIX record lock, ``lockf``: released when the process ends, kill -9 included, so a
    dead run never blocks its resume; unlike ``flock``'s, not inherited by forked children,
    which may outlive it; NFS passes it to the server). Returns the open lock file (close it
    to release; never open and close that file elsewhere in the process: that drops a POSIX
    lock). Another process holding it is a RuntimeError naming the folder and that process
    (``host:pid``). A filesystem that cannot lock (ENOLCK, ENOSYS, EOPNOTSUPP: e.g. Lustre
    mounted without flock) is logged and the run goes on unlocked. A lock held from another
    host is waited for up to ``$HACPO_RUN_LOCK_WAIT_S`` (default 120) seconds first: a node
    that died holding it keeps it on a network filesystem until its lease ends. The lock
    file may be removed while held (before ``close()``): a process that opened it before
    then takes the new file instead."""
    key = os.path.realpath(os.path.join(out_dir, name))
    with _HELD_GUARD:   # POSIX locks are per process: a second run of this one (two threads,
        if key in _HELD:    # a notebook) would take it again, and its close() drop the first's
            raise RuntimeError(f"{out_dir} is in use by another hacpo {user} in this process "
                               f"({socket.gethostname()}:{os.getpid()}): wait for it to end, "
                               f"or {other}")
        _HELD.add(key)
    try:
        return _HeldLock(_lock_file(out_dir, name, user, other), key)
    except BaseException:
        with _HELD_GUARD:
            _HELD.discard(key)
        raise


def run_dir_holder(out_dir: str) -> str | None:
    """``host:pid`` of the run that holds ``out_dir``'s lock now, or None (no lock file, free,
    or a filesystem that cannot lock). For a launcher: refuse before it starts a cluster whose
    driver would be refused."""
    import fcntl

    path = os.path.join(out_dir, RUN_LOCK)
    with _HELD_GUARD:
        if os.path.realpath(path) in _HELD:
            return f"{socket.gethostname()}:{os.getpid()}"
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "a+") as f:    # (this process holds no lock there: closing drops none)
            try:
                fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    return None
                f.seek(0)
                return f.read().strip() or "unknown"
            fcntl.lockf(f.fileno(), fcntl.LOCK_UN)
            return None
    except OSError:
        return None


# lock files this process holds (realpath), guarded: lockf cannot tell its own process's runs apart
_HELD: set[str] = set()
_HELD_GUARD = threading.Lock()


class _HeldLock:
    """The open lock file of a folder this process holds; ``close()`` releases both."""

    def __init__(self, f, key: str):
        self._f, self._key = f, key

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            with _HELD_GUARD:
                _HELD.discard(self._key)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _lock_file(out_dir: str, name: str, user: str, other: str):
    """lock_dir's lock of ``<out_dir>/<name>`` against other processes."""
    import fcntl

    path = os.path.join(out_dir, name)
    f = open(path, "a+")
    deadline = None
    try:
        while True:
            try:
                fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    return _unlocked(f, out_dir, e, user)
            else:
                if _same_file(f, path):
                    break
                # its holder removed it as it ended: the lock is the file now at path
                f.close()
                f = open(path, "a+")
                continue
            f.seek(0)
            holder = f.read().strip() or "unknown"
            host = holder.rpartition(":")[0]
            if host and host != socket.gethostname():
                # another host's lock may be a dead node's, which a network filesystem frees
                # only when the node's lease ends (~90 s on NFSv4): a requeued job waits
                wait_s = float(os.environ.get(RUN_LOCK_WAIT_ENV, "120"))
                if deadline is None:
                    deadline = time.monotonic() + wait_s
                    logging.getLogger("hacpo").warning(
                        f"{out_dir} is locked by {holder}; waiting up to {wait_s:g} s for it "
                        f"(a dead node's lock ends with its filesystem lease)")
                if time.monotonic() < deadline:
                    time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
                    continue
            raise RuntimeError(f"{out_dir} is in use by another hacpo {user} (process "
                               f"{holder}, lock {path}" + (f", still held after {wait_s:g} s"
                                                           if deadline is not None else "")
                               + f"): wait for it to end (or stop it), or {other}")
    except BaseException:
        f.close()
        raise
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{socket.gethostname()}:{os.getpid()}\n")
        f.flush()
    except OSError as e:     # a full disk: the error names no file
        f.close()
        raise StorageError.like(e, f"cannot write {path}: {describe_os_error(e)}", path) from None
    return f


def _same_file(f, path: str) -> bool:
    """Whether ``path`` still names the open file ``f`` (not removed or replaced)."""
    try:
        a, b = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _unlocked(f, out_dir: str, e: OSError, user: str = "run"):
    """A filesystem that cannot lock: logged, the work goes on unlocked; other errors raise."""
    if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
        f.close()
        raise e
    logging.getLogger("hacpo").warning(
        f"cannot lock the {user} folder {out_dir} ({e}): a second {user} there at the same "
        f"time would not be detected")
    return f


def _train(cfg: TrainConfig, rc: RewardComputer, resume: bool,
           accept_encoding: bool | tuple[str, ...], echo) -> dict:
    with user_errors():     # the run's inputs: config, run dir, checkpoint, data, warm start
        data, policies, state, warm, ck_path = _prepare(cfg, resume, accept_encoding, echo)
    agents = build_agents(cfg, policies)   # first: a Ray cluster it starts also holds the engine
    try:
        engine = build.rollout_engine(cfg, policies, agents)
        try:
            return _run(cfg, rc, data, agents, engine, state, warm, ck_path, echo)
        finally:
            engine.close()
    finally:
        agents.close()


def _stored_fingerprint(fp):
    """A checkpoint's config fingerprint as this version would write it for the same run: the
    policy settings the run's build never used and this version refuses (an old run's
    misspelt ``hf_config`` key, an HF setting on a decoder: drop_unused_policy_settings) left
    out, so the run resumes once the user removes them. A copy; other differences stay."""
    fp = resolve_stored_paths(copy.deepcopy(fp))   # relative paths: from this directory
    for a in fp.get("agents", []) if isinstance(fp, dict) else []:
        if isinstance(a, dict) and isinstance(a.get("policy"), dict):
            drop_unused_policy_settings(a["policy"])
    return fp


def _results_held(out_dir: str) -> list[str]:
    """The result files of a run in ``out_dir``: a metrics.jsonl with any row, a summary.json."""
    held = []
    for name in ("metrics.jsonl", "summary.json"):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            held.append(name)
    return held


def _foreign_files(out_dir: str) -> list[str]:
    """What in ``out_dir`` says it is not a run dir: a model folder (an export, a Hugging Face
    checkpoint: weights, a config.json that is not a run's), whose config.json a run would
    overwrite."""
    found = [name for name in ("hacpo_export.json", "model.safetensors",
                               "model.safetensors.index.json", "pytorch_model.bin")
             if os.path.exists(os.path.join(out_dir, name))]
    if _run_config_held(out_dir) is False:
        found.append("a config.json that is not a run's")
    return found


def _run_config_held(out_dir: str) -> bool | None:
    """Whether ``out_dir``'s config.json is a run's (None: there is none)."""
    path = os.path.join(out_dir, "config.json")
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
        return isinstance(obj, dict) and "agents" in obj
    except (OSError, ValueError):       # unreadable, not JSON
        return False


def _heldout_check(cfg: TrainConfig, data, state: dict, ck_path: str) -> None:
    """The held-out set must be the one the checkpoint's run evaluated "before RL" on (its
    before/after comparison and eval curves would mix two sets); older checkpoints do not
    record it."""
    want = state.get("heldout")
    if want is None or want == content_digest(data.eval):
        return
    d = cfg.data
    src = f"data.eval_path {d.eval_path}" if d.task == "files" else f"data.task {d.task}"
    raise ValueError(f"cannot resume {ck_path}: the held-out set changed since it was written "
                     f"({src}: {len(data.eval)} examples, content {content_digest(data.eval)}; "
                     f"the run evaluated content {want}): restore it, or start a new run")


def _prepare(cfg: TrainConfig, resume: bool, accept_encoding: bool | tuple[str, ...], echo):
    """Everything before the trainers start: checks, run dir, the checkpoint to resume, data,
    policies and their warm start."""
    ck_path = os.path.join(cfg.out_dir, CHECKPOINT)
    state = None
    _check_link(ck_path)
    if resume and os.path.exists(ck_path):
        state = ckpt.load(ck_path)
        _check_resumable(cfg, state, ck_path)
    held = _check_new_run(cfg, resume, ck_path) if state is None else []
    if resume and state is None:      # results replaced: a warning (compare passes it on)
        echo((f"[warn] no {CHECKPOINT} in {cfg.out_dir}: starting a new run there "
              f"({', '.join(held)} of the run before are replaced)") if held else
             f"[resume] no {CHECKPOINT} in {cfg.out_dir}: starting a new run there")
    data = build.load_data(cfg)
    if state is not None:       # the data cursor fits the examples (before any policy is built)
        try:
            PromptSampler(data.train, seed=cfg.seed).load_state_dict(state["sampler"])
        except ValueError as e:
            d = cfg.data
            src = f"data.train_path {d.train_path}" if d.task == "files" else f"data.task {d.task}"
            raise ValueError(f"cannot resume {ck_path}: the training data changed since it was "
                             f"written ({src}): {e}") from None
        _heldout_check(cfg, data, state, ck_path)
    policies = build.build_policies(cfg, data)
    if state is not None and (bad := build.tokenizer_mismatch(state, policies, cfg)):
        raise ValueError(f"cannot resume {ck_path}: {bad}")
    if state is not None:
        _check_encodings(state, policies, ck_path, accept_encoding, echo)
    check_prompt_lengths(cfg, data, policies)
    if cfg.rollout.engine == "vllm" and cfg.rollout.engine_tp > 1:   # the vocabulary vLLM must
        from hacpo.launch.vllm_rollout import check_engine_tp      # split is the tokenizer's:
        check_engine_tp(policies, cfg.rollout.engine_tp)            # before any trainer group
    for a, p in zip(cfg.agents, policies):     # what needs the real vocabulary: not the warm-up
        if a.trainer == "megatron":            # first, then a traceback from the trainer group
            from hacpo.models.megatron.build import check_megatron_policy
            check_megatron_policy(p, a.parallel)
    if state is None:       # a resume writes it once the checkpoint is loaded (_run)
        _write_config(cfg)
    vocab = max(p.tokenizer.vocab_size for p in policies)
    for note in (unused_algorithm_note(cfg), unused_rollout_note(cfg), unused_hook_note(cfg),
                 minibatch_shortfall(cfg), no_signal_note(cfg, vocab=vocab)):
        if note:
            echo(f"[warn] {note}")
    warm = build.warm_start(cfg, data, policies, echo) if state is None else state["warmup"]
    return data, policies, state, warm, ck_path


def _check_encodings(state: dict, policies, ck_path: str, accept: bool | tuple[str, ...],
                     echo) -> None:
    """A resume whose agents' tokenizers encode prompts otherwise than at the checkpoint: the
    steps after it would train on prompts the steps before never saw, silently. Refused, or
    for the agents ``accept`` takes (True: all; else their names) said and recorded in
    ``state["encoding_changes"]`` (the checkpoints after it carry the record on)."""
    bad = build.encoding_mismatches(state, policies)
    refused = [(n, why) for n, why in bad if accept is not True and n not in (accept or ())]
    if refused:
        # the flag that takes every change found (an agent named before: taken again)
        flag = " ".join(["--accept-encoding-change"] + [shlex.quote(n) for n, _ in bad])
        raise ValueError(f"cannot resume {ck_path}: {refused[0][1]}"
                         + (f" (and agent(s) {', '.join(n for n, _ in refused[1:])})"
                            if len(refused) > 1 else "")
                         + f"; restore the tokenizer files or package versions it was trained "
                           f"with, pass {flag} to go on with the encoding of now, or "
                           f"start a new run in another out_dir")
    if accept is True and not bad:
        echo("[resume] --accept-encoding-change: every agent's prompts are encoded as at "
             "the checkpoint (nothing to accept)")
    elif isinstance(accept, tuple):
        changed = {n for n, _ in bad}
        for n in accept:
            if n not in changed:
                echo(f"[resume] --accept-encoding-change {n}: agent {n}'s prompts are encoded "
                     f"as at the checkpoint (nothing to accept)")
    if not bad:
        return
    changes = list(state.get("encoding_changes") or [])
    for name, why in bad:
        echo(f"[warn] {why}: accepted (--accept-encoding-change): from step {state['step']} "
             f"on, agent {name} trains on prompts encoded by its tokenizer as it is now")
        changes.append({"agent": name, "step": int(state["step"])})
    state["encoding_changes"] = changes


def check_run_dir(cfg: TrainConfig, resume: bool) -> None:
    """What :func:`train` would refuse about ``cfg.out_dir`` and its checkpoint, checked
    without building anything, for a launcher before its job waits in a queue: a dangling
    checkpoint link, a run (checkpoint or results) there without ``resume``, new-run agent
    names, and a checkpoint ``resume`` cannot continue with this config (another config,
    ``steps`` below its step). Only the checkpoint's pickled fields are read (its tensors are
    memory-mapped, never loaded); its full load and CRC check are the run's. A checkpoint
    that cannot be read so is left to the run to report."""
    cfg = resolve_paths(copy.deepcopy(cfg))      # as train() compares them
    ck_path = os.path.join(cfg.out_dir, CHECKPOINT)
    _check_link(ck_path)
    if resume and os.path.isfile(ck_path):
        try:
            state = _checkpoint_fields(ck_path)
        except Exception:       # damaged, foreign, an older format: the run's load names it
            return
        _check_resumable(cfg, state, ck_path)
    else:
        _check_new_run(cfg, resume, ck_path)


def _check_link(ck_path: str) -> None:
    if os.path.islink(ck_path) and not os.path.exists(ck_path):
        # (a checkpoint volume not mounted): never "no checkpoint, start over" over its results
        raise FileNotFoundError(f"{ck_path} is a symbolic link to {os.readlink(ck_path)}, "
                                f"which does not exist: restore its target (or remove the link "
                                f"to start the run over)")


def _check_resumable(cfg: TrainConfig, state, ck_path: str) -> None:
    """The loaded checkpoint ``state`` is a hacpo run's that ``cfg`` continues."""
    if not isinstance(state, dict) or not {"step", "fingerprint", "agents",
                                            "sampler"} <= set(state):
        raise ValueError(f"{ck_path} is not a hacpo training checkpoint (no 'step', "
                         f"'fingerprint', 'agents' and 'sampler'); move it away to start "
                         f"a new run there")
    stored, now = _stored_fingerprint(state["fingerprint"]), fingerprint_dict(cfg)
    if _data_content_recorded(state):
        # data files moved (another mount, run and data copied to another machine): where they
        # are is no longer the run's; their content is checked against the checkpoint's record
        for key in ("train_path", "eval_path"):
            if isinstance(stored.get("data"), dict) and key in now.get("data", {}):
                stored["data"][key] = now["data"][key]
    try:
        _accept_moved_folders(state, stored, now)
    except ValueError as e:
        raise ValueError(f"cannot resume {ck_path}: {e}") from None
    diff = config_diff(stored, now, defaults=default_fingerprint(cfg))
    if diff:
        own = os.path.join(cfg.out_dir, "config.json")
        raise ValueError(f"cannot resume {ck_path}: the config differs from the "
                         f"checkpoint's in {', '.join(diff)} (resume with the run's own "
                         f"settings: " + (f"--config {own}, or " if os.path.isfile(own)
                                          else "") + "the --preset / --set it was started "
                         "with)")
    if state["step"] > cfg.steps:
        raise ValueError(f"cannot resume {ck_path} at step {state['step']} with steps="
                         f"{cfg.steps}: the run is past it (its metrics and checkpoint "
                         f"hold {state['step']} steps); pass steps >= {state['step']}")


def _accept_moved_folders(state: dict, stored: dict, now: dict) -> None:
    """A model or tokenizer folder of an agent's named at another place than the run's
    (agents.N.policy.path / tokenizer: run and models copied to another machine or mount) is
    no config difference once it is checked to hold what the checkpoint records of the run's
    (build.check_moved; a tokenizer's vocabulary, once built: tokenizer_mismatch). The
    stored fingerprint ``stored`` takes the new place."""
    pairs = zip(stored.get("agents") or [], now.get("agents") or [])
    for i, (was, new) in enumerate(pairs):
        was, new = was.get("policy") if isinstance(was, dict) else None, new.get("policy", {})
        for key in build.MOVABLE if isinstance(was, dict) else ():
            old, kind = was.get(key), new.get("kind")
            if old != new.get(key) and build.is_folder(key, old, kind) \
                    and build.is_folder(key, new.get(key), kind):
                build.check_moved(state, i, was.get("name"), key, old, new[key])
                was[key] = new[key]


def _literal_tilde_run(out_dir: str) -> str | None:
    """A run an older hacpo made for ``out_dir`` given as ``~/...`` unexpanded: in a folder
    named "~" of the current directory (None: no checkpoint there)."""
    try:            # (a current directory removed under the run: no such folder)
        here, home = os.getcwd(), os.path.expanduser("~")
    except OSError:
        return None
    rel = os.path.relpath(os.path.join(here, out_dir), home)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    old = os.path.normpath(os.path.join(here, "~", rel))
    return old if os.path.exists(os.path.join(old, CHECKPOINT)) else None


def _data_content_recorded(state: dict) -> bool:
    """Whether the checkpoint records its data's content: the training rows' (the data
    cursor's) and the held-out set's, which a resume checks (older ones: ids only)."""
    sampler = state.get("sampler")
    return isinstance(sampler, dict) and "content" in sampler and state.get("heldout") is not None


def _check_new_run(cfg: TrainConfig, resume: bool, ck_path: str) -> list[str]:
    """A new run (none to resume) may start in ``cfg.out_dir``; returns the result files of
    a run before that it replaces (only with ``resume``)."""
    check_new_run_names(cfg)    # names a stored run may keep (spaces, '->') new runs may not
    foreign = _foreign_files(cfg.out_dir)
    if foreign and not os.path.exists(ck_path):
        raise FileExistsError(f"{cfg.out_dir} is not a run dir: it holds {', '.join(foreign)} "
                              f"(a model folder? a run writes its own config.json there): "
                              f"choose another out_dir")
    literal = _literal_tilde_run(cfg.out_dir)
    if resume and literal and not os.path.exists(ck_path):
        raise FileNotFoundError(f"no {CHECKPOINT} in {cfg.out_dir}, but {literal} holds a run: "
                                f"a '~' in the run dir is the home directory now (it was a "
                                f"folder named '~' in the current directory): move that run "
                                f"to {cfg.out_dir} to resume it")
    if os.path.exists(ck_path) and not resume:
        raise FileExistsError(f"{cfg.out_dir} already holds a run ({CHECKPOINT}); pass --resume "
                              f"to continue it or choose another out_dir")
    held = _results_held(cfg.out_dir)
    if held and not resume:     # a run stopped before its first checkpoint, or whose
        raise FileExistsError(  # checkpoint was removed: its results are not overwritten
            f"{cfg.out_dir} holds the results of a run ({', '.join(held)}) but no {CHECKPOINT} "
            f"to continue it from (it stopped before its first checkpoint, or the checkpoint "
            f"was removed): pass --resume to start that run over there (replacing them), or "
            f"choose another out_dir")
    return held


def _carry_final_eval(cfg: TrainConfig, start: int, names: list[str]) -> dict:
    """A finished run extended (resumed at its last step ``start`` for more steps): its final
    held-out accuracies, in its summary.json that the longer run replaces, go to the metrics
    row of its last step as ``eval/<agent>/accuracy`` -- where an uninterrupted longer run
    evaluates (``eval_every`` divides ``start``; the same greedy evaluation). Returns what was
    added (for TensorBoard)."""
    if not (cfg.eval_every and 0 < start < cfg.steps and start % cfg.eval_every == 0):
        return {}
    try:
        with open(os.path.join(cfg.out_dir, "summary.json")) as f:
            summary = json.load(f)
        after = summary["after"] if summary.get("steps") == start else None
        values = {f"eval/{nm}/accuracy": float(after[nm]["accuracy"]) for nm in names}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}            # none, or not this run's finish: nothing to carry
    return values if amend_row(os.path.join(cfg.out_dir, "metrics.jsonl"), start - 1,
                               values) else {}


def _steps(steps: list[int]) -> str:
    """"step 4" / "steps 10-14" / "steps 3, 5, 8" (``steps``: not empty)."""
    steps = sorted(set(steps))
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps[-1] - steps[0] + 1 == len(steps):
        return f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")


def _checkpoint_fields(ck_path: str) -> dict:
    """The checkpoint at ``ck_path`` with its tensors memory-mapped, never read: its pickled
    fields only (raises what torch.load raises)."""
    return torch.load(ck_path, map_location="cpu", mmap=True, weights_only=True)


def _checkpoint_step(ck_path: str, default: int | None) -> int | None:
    """The step of the checkpoint at ``ck_path`` (:func:`_checkpoint_fields`); ``default`` if
    it cannot be read so."""
    try:
        return int(_checkpoint_fields(ck_path)["step"])
    except Exception:
        return default


def _stopped_note(saved: int | None, logged: int, every: int) -> str:
    """Where `--resume` goes on from a run stopped after logging steps < ``logged``, its last
    checkpoint at ``saved`` (None: none yet): the steps logged since run again."""
    if saved is None:
        return "[stop] no checkpoint yet: --resume starts the run over"
    if logged <= saved:
        return f"[stop] the last checkpoint is at step {saved}: --resume goes on from there"
    return (f"[stop] the last checkpoint is at step {saved} (checkpoint_every={every}): "
            f"--resume runs {_steps(list(range(saved, logged)))} again")


def _write_config(cfg: TrainConfig, finished: bool = False) -> None:
    """``<out_dir>/config.json``, written once every check of the run's inputs passed: a run or
    resume refused for its config, data or checkpoint leaves the run dir as it was. A
    summary.json there marks a finished run: unless the run is (a resume at its last step),
    it is the summary of a run before (started over, or resumed for more steps) and goes, with
    that run's plots (a run with plots=false left them looking like its own); the run writes
    its own when it finishes. Only a run's: a folder that held no run (no config.json of a
    run, results or checkpoint) keeps files of those names (a project folder as the run dir)."""
    held_run = (_run_config_held(cfg.out_dir) or _results_held(cfg.out_dir)
                or os.path.exists(os.path.join(cfg.out_dir, CHECKPOINT)))
    ckpt.write_text_atomic(os.path.join(cfg.out_dir, "config.json"),
                           json.dumps(cfg.to_dict(), indent=2))
    if not finished and held_run:
        for name in ("summary.json", *PLOT_FILES):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(cfg.out_dir, name))


def _greedy_by_top_p(cfg: TrainConfig, vocab: int, G: int) -> str:
    own_only = not cfg.algorithm.shares_samples or len(cfg.agents) == 1
    return (f"rollout.top_p={cfg.rollout.top_p} <= 1/{vocab} (the largest agent vocabulary): "
            f"nucleus sampling keeps the most likely token alone, so sampling is greedy and "
            f"each agent's {G} responses to a prompt are identical"
            + (f" (every {cfg.algorithm.name} group has one reward: no policy-gradient signal)"
               if own_only else " (a group differs only between agents)")
            + (f", as are eval_pass_k={cfg.eval_pass_k}'s samples" if cfg.eval_pass_k > 1 else "")
            + "; raise rollout.top_p")


def minibatch_shortfall(cfg: TrainConfig) -> str | None:
    """A note when a step cannot make the configured number of updates: minibatches split by
    prompt (``minibatch_order="mixed"``) with fewer prompts per step than minibatches leave
    some empty, and an empty minibatch is no update (algorithm.split_minibatches). Then each
    agent makes at most ``prompts_per_step`` updates of one prompt each, the stepwise clip's
    index stays below that, and gspo2x's minibatches are no smaller than gspo's. None when the
    configured count is made."""
    algo = cfg.algorithm
    M = algo.num_minibatches * algo.minibatch_factor
    P = cfg.prompts_per_step
    what = (f"algorithm.num_minibatches={algo.num_minibatches}"
            + (f" x {algo.minibatch_factor} for {algo.name}" if algo.minibatch_factor > 1 else ""))
    if algo.minibatch_order == "self_first":     # contiguous pieces of a learner's samples
        n = len(cfg.agents) if algo.shares_samples else 1
        G = cfg.rollout.group_size * algo.samples_per_prompt_factor
        N = P * G * n
        if N >= M:
            return None
        return (f"{M} minibatches per step ({what}), but a learner has at most {N} samples "
                f"a step (prompts_per_step={P} x {G} responses"
                + (f" x {n} agents" if n > 1 else "") + f"; minibatch_order="
                f"self_first cuts them into pieces): at most {N} update{'s' if N > 1 else ''} "
                f"per step, not {M}; raise prompts_per_step or lower algorithm.num_minibatches")
    if P >= M:
        return None
    return (f"{M} minibatches per step ({what}), but minibatches are split by prompt "
            f"(algorithm.minibatch_order=mixed) and a step has prompts_per_step={P}: each "
            f"agent makes at most {P} update{'s' if P > 1 else ''} per step, not {M} (the "
            f"stepwise clip index stays below {P}); raise prompts_per_step to {M} or lower "
            f"algorithm.num_minibatches")


def unused_algorithm_note(cfg: TrainConfig) -> str | None:
    """A note naming the algorithm settings the run's algorithm never reads that differ from
    their defaults (``--algorithm grpo --set algorithm.loss.alpha=0``: trained as plain grpo).
    A note, not an error: compare applies the user's settings to each of its algorithms."""
    unused = cfg.algorithm.unused_settings()
    if not unused:
        return None
    algo = cfg.algorithm
    clip = (f" with loss.cross_clip={algo.loss.cross_clip}"
            if algo.name == "hacpo" and algo.loss.cross_clip != "stepwise" else "")
    return (f"{', '.join(unused)}: algorithm {algo.name}{clip} never reads "
            f"{'these' if len(unused) > 1 else 'this'} (the run trains as if "
            f"{'they were' if len(unused) > 1 else 'it was'} not set)")


def unused_rollout_note(cfg: TrainConfig) -> str | None:
    """A note naming the Ray / vLLM rollout pools' settings of a run with the in-process
    engine (``rollout.engines_per_agent=4`` without ``rollout.engine=ray``: one local sampler)."""
    unused = unused_rollout_settings(cfg)
    if not unused:
        return None
    return (f"{', '.join(unused)}: for the Ray / vLLM rollout pools (rollout.engine=ray or "
            f"vllm" + (", or a Ray trainer" if any("ray_address" in u for u in unused) else "")
            + f"); this run samples in-process (rollout.engine=local) and never reads "
            f"{'them' if len(unused) > 1 else 'it'}")


def unused_hook_note(cfg: TrainConfig) -> str | None:
    """A note when ``trainer_setup_hook`` is set but no agent is a megatron trainer group (the
    only processes that run it): a misspelt module would otherwise pass unnoticed."""
    if not cfg.trainer_setup_hook or any(a.trainer == "megatron" for a in cfg.agents):
        return None
    return (f"trainer_setup_hook={cfg.trainer_setup_hook!r} runs in megatron trainer ranks "
            f"only (agents.N.trainer=megatron); this run has none, so it never runs")


def no_signal_note(cfg: TrainConfig, vocab: int | None = None) -> str | None:
    """A note when a prompt's group cannot hold two different responses, so every advantage is
    0 and the run gets no policy gradient (SPEC: uniform-reward groups give zero advantages):
    a group of one agent's samples (grpo, gspo, gspo2x; any algorithm with one agent) with
    one response per prompt (G = 1), or with greedy rollouts (``rollout.temperature=0``: an
    agent's G responses are identical). With two agents or more, hacpo / naive groups hold
    every agent's responses: greedy, they differ only between agents (said too). Also: a
    pass@k (``eval_pass_k``) sampled at temperature 0 is k identical greedy responses, i.e.
    avg@1. ``vocab`` (the largest agent vocabulary): a ``rollout.top_p`` <= 1 / vocab is
    greedy too (the most likely token alone holds at least that mass, and nucleus sampling
    keeps the next one only below it). None when none of these applies."""
    algo, ro = cfg.algorithm, cfg.rollout
    G = ro.group_size * algo.samples_per_prompt_factor
    greedy = ro.temperature == 0
    own_only = not algo.shares_samples or len(cfg.agents) == 1
    notes = []
    if own_only and G == 1:
        notes.append(f"rollout.group_size=1: each {algo.name} group holds one response, so "
                     f"every advantage is 0 (no policy-gradient signal); use "
                     f"rollout.group_size >= 2")
    elif not greedy and vocab is not None and ro.top_p <= 1 / vocab:
        return _greedy_by_top_p(cfg, vocab, G)
    elif own_only and greedy:
        notes.append(f"rollout.temperature=0 (greedy): each agent's {G} responses to a prompt "
                     f"are identical, so every {algo.name} group has one reward and every "
                     f"advantage is 0 (no policy-gradient signal); sample with "
                     f"rollout.temperature > 0")
    elif greedy and G > 1:
        notes.append(f"rollout.temperature=0 (greedy): each agent's {G} responses to a prompt "
                     f"are identical, so a group differs only between agents; sample with "
                     f"rollout.temperature > 0 (or rollout.group_size=1)")
    if greedy and cfg.eval_pass_k > 1:
        notes.append(f"eval_pass_k={cfg.eval_pass_k} samples at the rollout temperature, 0: "
                     f"{cfg.eval_pass_k} identical greedy responses, so pass@"
                     f"{cfg.eval_pass_k} and avg@{cfg.eval_pass_k} equal greedy avg@1")
    return "; ".join(notes) or None


def check_prompt_lengths(cfg: TrainConfig, data, policies) -> None:
    """Every templated prompt fits each agent's positions with the tokens it may generate:
    a training prompt's tokens + ``rollout.max_new_tokens``, a held-out one's + the evaluation's
    new tokens, at most the policy's ``max_len`` (the sampler refuses more). Checked before the
    warm-up; otherwise the run would stop with a traceback at the first step (or evaluation)
    that draws such a prompt, and a resume would draw it again. A ValueError naming the agent,
    how many prompts are too long and the longest."""
    max_new = cfg.rollout.max_new_tokens
    files = cfg.data.task == "files"
    splits = (("training" + (f" ({cfg.data.train_path})" if files else ""), data.train,
               "rollout.max_new_tokens", max_new),
              ("held-out" + (f" ({cfg.data.eval_path})" if files else ""), data.eval,
               "eval_max_new_tokens" if cfg.eval_max_new_tokens else "rollout.max_new_tokens",
               cfg.eval_max_new_tokens or max_new))
    for k, p in enumerate(policies):
        lengths = []        # per split: prompt text -> its tokens
        for split, examples, key, new in splits:
            ids_of: dict[str, list[str]] = defaultdict(list)     # prompt text -> example ids
            for e in examples:
                ids_of[build.prompt_text(cfg, e)].append(e.id)
            room = p.max_len - new

            def n_tokens(text: str, ids: list[str]) -> int:
                try:
                    return len(p.tokenizer.prompt_ids(text))
                except UnencodableTextError as e:   # e.g. a template's characters
                    raise ValueError(
                        f"agent {p.name!r} (agents.{k}): the {split} prompt of example "
                        f"{ids[0]!r} (data.template={cfg.data.template!r}) cannot be "
                        f"tokenized: {e}") from None

            lengths.append(_prompt_lengths(p.tokenizer, list(ids_of),
                                           lambda t: n_tokens(t, ids_of[t])))
            too_long = [(n, ids_of[t]) for t, n in lengths[-1].items() if n > room]
            if not too_long:
                continue
            count = sum(len(ids) for _, ids in too_long)
            n, ids = max(too_long, key=lambda x: x[0])
            fit = (f"at most {room} fit" if room > 0
                   else f"{key}={new} alone leaves no room for a prompt")
            raise ValueError(
                f"agent {p.name!r} (agents.{k}): {count} of {len(examples)} {split} prompts do "
                f"not fit its max_len={p.max_len} with {key}={new} new tokens (the longest, "
                f"example {ids[0]!r}, has {n} prompt tokens; {fit}): give the policy a longer "
                f"max_len, lower {key}, or remove those examples")
        if cfg.agents[k].warmup.steps > 0:      # the training prompts' lengths, not again
            _check_warmup_lengths(cfg, data, p, k, prompt_len=lengths[0])


def _prompt_lengths(tok, texts: list[str], one) -> dict[str, int]:
    """Tokens of each prompt text, encoded a slice at a time (``prompt_ids_batch``); a slice
    with a text that cannot be tokenized goes again one text at a time through ``one`` (text
    -> tokens), which raises for the first such text as the check always did."""
    out: dict[str, int] = {}
    for chunk in batches(texts):
        try:
            out.update(zip(chunk, map(len, tok.prompt_ids_batch(chunk))))
        except UnencodableTextError:
            out.update((t, one(t)) for t in chunk)
    return out


def _check_warmup_lengths(cfg: TrainConfig, data, p, k: int,
                          prompt_len: dict[str, int] | None = None) -> None:
    """The warm-up trains on prompt + worked solution + EOS of training examples it draws at
    random: one longer than the agent's max_len stopped it mid-way ("prompt+response of 155
    tokens exceeds max_len=140", no example named). Checked with the prompts, before it;
    ``prompt_len``: the training prompts' tokens where :func:`check_prompt_lengths` counted
    them (filled in here)."""
    prompt_len = {} if prompt_len is None else prompt_len
    tok = p.tokenizer

    def n_tokens(e, text: str) -> int:      # one example (a slice's fallback)
        if text not in prompt_len:
            prompt_len[text] = len(tok.prompt_ids(text))
        try:
            return prompt_len[text] + len(tok.response_ids(data.target_text(e), add_eos=True))
        except UnencodableTextError as err:
            raise ValueError(f"agent {p.name!r} (agents.{k}): the warm-up target of example "
                             f"{e.id!r} cannot be tokenized: {err}") from None

    too_long = []
    for chunk in batches(data.train):
        texts = [build.prompt_text(cfg, e) for e in chunk]
        try:
            prompt_len.update(_prompt_lengths(
                tok, [t for t in dict.fromkeys(texts) if t not in prompt_len],
                lambda t: len(tok.prompt_ids(t))))
            targets = tok.response_ids_batch([data.target_text(e) for e in chunk], add_eos=True)
            ns = [prompt_len[t] + len(ids) for t, ids in zip(texts, targets)]
        except UnencodableTextError:    # again one example at a time: the error names the first
            ns = [n_tokens(e, t) for e, t in zip(chunk, texts)]
        too_long.extend((n, e.id) for n, e in zip(ns, chunk) if n > p.max_len)
    if too_long:
        n, eid = max(too_long)
        raise ValueError(
            f"agent {p.name!r} (agents.{k}): {len(too_long)} of {len(data.train)} training "
            f"examples do not fit its max_len={p.max_len} in the warm-up, which trains on the "
            f"prompt + worked solution + EOS (the longest, example {eid!r}, has {n} tokens): "
            f"give the policy a longer max_len, set agents.{k}.warmup.steps=0, or remove those "
            f"examples")


def _run(cfg, rc, data, agents, engine, state, warm, ck_path, echo) -> dict:
    policies, names = agents.policies, agents.names   # driver-side: tokenizers, engine weights
    n = len(policies)
    tracker = CapabilityTracker(n, **vars(cfg.algorithm.capability))
    sampler = PromptSampler(data.train, seed=cfg.seed)
    shuffle_gen = torch.Generator().manual_seed(cfg.seed + 7)
    nonfinite = {"streak": 0, "total": 0}
    # plots: sequence-ratio counts per "<agent>/<part>" (RATIO_EDGES), summed over the steps
    ratio_log: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(len(RATIO_EDGES) - 1,
                                                                    dtype=np.int64))
    # what checkpoints record of the tokenizers and model folders (checked on resume, eval)
    inputs = {**build.tokenizer_record(policies), **build.model_record(cfg),
              # the steps at which a resume accepted an agent's changed encoding (_prepare)
              "encoding_changes": list((state or {}).get("encoding_changes") or [])}
    heldout = content_digest(data.eval)    # the set "before RL" was measured on
    if state is None:
        before, start = None, 0
    else:
        with user_errors(ValueError, KeyError):    # e.g. a checkpoint of another layout
            for k, s in enumerate(state["agents"]):
                try:
                    agents.load_state_dict(k, s)
                except RuntimeError as e:   # torch's load_state_dict: other shapes or entries
                    raise ValueError(f"cannot resume {ck_path}: agent {names[k]}'s weights "
                                     f"do not fit its policy (a vocabulary reduced to data "
                                     f"that changed since? {build.vocab_source(cfg)}): "
                                     f"{e}") from None
            tracker.load_state_dict(state["tracker"])
            sampler.load_state_dict(state["sampler"])
            engine.load_state_dict(state["engine"])
            shuffle_gen.set_state(state["shuffle_gen"])
            nonfinite = state["nonfinite"]
            before, start = state["eval_before"], state["step"]
        # the ratio counts up to the checkpoint (older checkpoints: every ratio, counted now;
        # older still: none kept)
        ratio_log.update({key: np.asarray(v, dtype=np.int64)
                          for key, v in state.get("ratio_hist", {}).items()})
        ratio_log.update({key: ratio_counts(np.asarray(v))
                          for key, v in state.get("ratio_log", {}).items()})
        echo(f"[resume] {ck_path} at step {start}")
    # engines holding weight copies start from these weights (the pools: all agents at once)
    sync_agents(agents, engine, n, timer=null_timer, pull=False, at_once=cfg.agents_at_once)
    if not data.eval:
        echo("[eval] no held-out set (data.eval_size=0): held-out evaluation skipped")
        before = {name: None for name in names}
    elif before is None:
        echo("[eval] held-out accuracy before RL ...")
        before = evaluate_all(cfg, data, agents, engine, rc)
    for name in names:
        if before[name] is not None:
            echo(f"[eval] {name}: before RL {before[name]['accuracy']:.3f} "
                 f"(SE {before[name]['stderr']:.3f})")

    with user_errors(ValueError):          # a metrics.jsonl line that cannot be read
        logger = MetricsLogger(cfg.out_dir, start_step=start, tensorboard=cfg.tensorboard
                               and missing_feature(cfg, "tensorboard") is None)
    if logger.dropped:
        one = len(logger.dropped) == 1
        again = [st for st in logger.dropped if st < cfg.steps]
        echo(f"[resume] metrics.jsonl's {'row' if one else 'rows'} of "
             f"{_steps(logger.dropped)}, logged after the checkpoint, {'is' if one else 'are'} "
             f"dropped: " + (f"{_steps(again)} {'runs' if len(again) == 1 else 'run'} again"
                             if again else f"this run ends at step {cfg.steps}"))
    algo = cfg.algorithm
    G = cfg.rollout.group_size * algo.samples_per_prompt_factor
    bar = _progress(cfg, start)
    saved = start if state is not None else None     # the step the last checkpoint resumes at
    saving = None                                    # the step of a checkpoint being written
    logged = start

    def save(at: int) -> None:       # the checkpoint a resume continues at step ``at``
        nonlocal saved, saving
        saving = at
        _save(ck_path, cfg, at, agents, tracker, sampler, engine, shuffle_gen, nonfinite, warm,
              before, ratio_log, inputs, heldout)
        agents.checkpoint_saved()      # e.g. drop optimizer shards no checkpoint names
        saved, saving = at, None

    def stop_if_requested(at: int) -> None:   # request_stop() (SIGUSR1): here, checkpointed
        raise_lost_interrupt()    # a Ctrl-C / SIGTERM Python dropped (hacpo._stop): here
        if stop_requested():
            if saved != at:
                save(at)
            clear_stop_request()               # taken up (one arriving after: the caller's)
            echo(f"[stop] stop requested: the checkpoint at step {at} is written; --resume "
                 f"goes on from there")
            raise RunStopped(at, cfg.out_dir)
    try:
        if state is not None:   # once metrics.jsonl is read (a resume refused for a line of it
            # keeps the summary.json of a finished run)
            carried = _carry_final_eval(cfg, start, names)
            if carried:
                logger.tensorboard_scalars(start - 1, carried)
            _write_config(cfg, finished=start == cfg.steps)
        if start < cfg.steps:     # asked during the warm-up or the evaluation before RL
            stop_if_requested(start)
        for step in range(start, cfg.steps):
            sw = Stopwatch(device_sync(cfg.profile_sync))
            t_step = time.perf_counter()
            batch = sampler.next_batch(cfg.prompts_per_step)
            prompt_ids = [[p.tokenizer.prompt_ids(build.prompt_text(cfg, e)) for e in batch]
                          for p in policies]
            # the Ray / vLLM pools sample all agents at once (rollout.generate_agents)
            with sw("time/generate"):
                ros = generate_agents(engine, prompt_ids, at_once=cfg.agents_at_once,
                                      timer=lambda k: sw(f"time/generate/{names[k]}"),
                                      num_samples=G, max_new_tokens=cfg.rollout.max_new_tokens,
                                      temperature=cfg.rollout.temperature,
                                      top_p=cfg.rollout.top_p)
            rollouts = [(ro, p.tokenizer) for ro, p in zip(ros, policies)]
            engine.idle()                  # colocated engines free their GPUs for the trainer
            pool = build_pool(rollouts)
            with sw("time/reward"):
                pool.rewards, rstats = score_batch(rc, pool, [e.answer for e in batch], names)
            tracker.update(pool.rewards, pool.agent)
            ratios = tracker.ratios()
            with sw("time/old_logprobs"):
                agents.old_logprobs(pool, prompt_ids, cfg.micro_batch, score_temperature(cfg), sw)
            metrics: dict[str, float] = {}
            retok = RetokStats()
            views = []
            for k in range(n):
                idx, adv = learner_samples(algo, pool.rewards, pool.prompt, pool.agent,
                                           learner=k, ratios=ratios)
                omega = sample_omega(algo, pool.agent[idx], k, ratios)
                with sw(f"time/retokenize/{names[k]}"):
                    views.append(learner_view(pool, k, idx, adv, omega, policies, prompt_ids,
                                              cfg.rollout.max_new_tokens, retok,
                                              cfg.drop_unencodable))
            # every agent's update (Ray actors and megatron groups at once: update_agents),
            # then every agent's weights to its engines (the Ray / vLLM pools: all at once)
            rls = [{} if cfg.plots else None for _ in range(n)]
            with sw("time/update"):
                ms = update_agents(agents, views, pool, generator=shuffle_gen,
                                   nonfinite=nonfinite, ratio_logs=rls, sw=sw,
                                   timer=lambda k: sw(f"time/update/{names[k]}"),
                                   at_once=cfg.agents_at_once)
            with sw("time/sync"):
                sync_agents(agents, engine, n, timer=lambda k: sw(f"time/sync/{names[k]}"),
                            at_once=cfg.agents_at_once)
            for k, (view, m, rl) in enumerate(zip(views, ms, rls)):
                for stage in UPDATE_STAGES:        # same keys every step, 0 when idle
                    sw.setdefault(f"time/{stage}/{names[k]}", 0.0)
                metrics.update(_view_tokens(view, names[k]))
                metrics[f"tokens/forward_prompt/{names[k]}"] = m.pop("tokens_forward_prompt", 0.0)
                if "tokens_update_padded" in m:     # megatron groups: what their forwards ran
                    metrics[f"tokens/update_padded/{names[k]}"] = m.pop("tokens_update_padded")
                    metrics[f"batch/micro_batches/{names[k]}"] = m.pop("update_micro_batches")
                if rl:
                    for kind, vals in rl.items():
                        ratio_log[f"{names[k]}/{kind}"] += ratio_counts(torch.cat(vals).numpy())
                metrics.update({f"train/{names[k]}/{key}": v for key, v in m.items()})
                for key, v in view.dropped.items():
                    metrics[f"dropped/{names[k]}/{key}"] = float(v)
            metrics.update(_step_metrics(pool, tracker, ratios, names, rstats, retok))
            metrics.update(engine_metrics(engine.stats()))
            metrics.update(sw)
            metrics["time/step"] = time.perf_counter() - t_step
            if (data.eval and cfg.eval_every and (step + 1) % cfg.eval_every == 0
                    and step + 1 < cfg.steps):
                for name, r in evaluate_all(cfg, data, agents, engine, rc).items():
                    metrics[f"eval/{name}/accuracy"] = r["accuracy"]
            logger.log(step, metrics)
            logged = step + 1
            if bar is not None:
                bar.set_postfix({nm: f"{metrics[f'reward/{nm}']:.2f}" for nm in names})
                bar.update(1)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save(step + 1)
            stop_if_requested(step + 1)    # (the last step's too: the resume evaluates)
        if cfg.steps == 0 and start == 0:
            # the warm start as a checkpoint: `hacpo eval` scores it on other benchmarks (the
            # baseline before RL) and `--resume` with steps > 0 trains on from it
            save(0)
    except (KeyboardInterrupt, SystemExit):      # Ctrl-C, SIGTERM: where a resume goes on
        if saving is not None:   # a stop held while the checkpoint was written: written or not
            saved = _checkpoint_step(ck_path, saved)
        echo(_stopped_note(saved, logged, cfg.checkpoint_every))
        raise
    finally:
        if bar is not None:
            bar.close()
        logger.close()
    if data.eval:
        echo("[eval] held-out accuracy after RL ...")
        after = evaluate_all(cfg, data, agents, engine, rc, pass_k=cfg.eval_pass_k)
    else:
        after = {name: None for name in names}
    summary = {"before": before, "after": after, "warmup": warm, "steps": cfg.steps,
               "algorithm": algo.name, "agents": names, "data": data.load_stats,
               "config_hash": config_hash(cfg.to_dict())}     # the config that finished
    if cfg.plots:
        if ratio_log:
            arrays = {"edges": RATIO_EDGES, **ratio_log}
            ckpt._write_atomic(os.path.join(cfg.out_dir, RATIO_FILE),
                               lambda f: np.savez_compressed(f, **arrays))
        from .plots import plot_run
        try:
            plot_run(cfg.out_dir, names)
        except Exception as e:   # e.g. a matplotlib backend error: the run itself finished
            summary["plots_error"] = f"{type(e).__name__}: {e}"
            echo(f"[plots] not written: {summary['plots_error']} (the run's results are "
                 f"complete: summary.json, metrics.jsonl, checkpoint.pt)")
    # last: summary.json marks the run finished (`hacpo compare` resumes a run without one),
    # so a run killed while it wrote its plots is not taken for finished with plots missing
    ckpt.write_text_atomic(os.path.join(cfg.out_dir, "summary.json"),
                           json.dumps(summary, indent=2))
    for name in names:
        b, a = before[name], after[name]
        if a is None:
            continue
        # equal accuracies summed in another order differ by ~1e-17: "+0.000", not "-0.000"
        diff = round(a["accuracy"] - b["accuracy"], 12) + 0.0
        se = (a["stderr"] ** 2 + b["stderr"] ** 2) ** 0.5
        echo(f"[result] {name}: held-out accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f} "
             f"({diff:+.3f}" + (f", {diff / se:+.1f} SE" if se else ", SE 0") + f") on "
             f"{b['n']} problems")
    return summary


def _step_metrics(pool, tracker, ratios, names, rstats, retok) -> dict[str, float]:
    out = {}
    phat = tracker.phat()
    for k, name in enumerate(names):
        sel = pool.agent == k
        lens = [len(r) for r, s in zip(pool.response_ids, sel.tolist()) if s]
        out[f"tokens/generated/{name}"] = float(sum(lens))
        out[f"reward/{name}"] = float(pool.rewards[sel].mean())
        out[f"phat/{name}"] = float(phat[k])
        out[f"response_tokens/{name}"] = sum(lens) / max(len(lens), 1)
        fin = [f for f, s in zip(pool.finished_eos, sel.tolist()) if s]
        tr = [t for t, s in zip(pool.truncated, sel.tolist()) if s]
        out[f"eos_rate/{name}"] = sum(fin) / max(len(fin), 1)
        out[f"truncated/{name}"] = float(sum(tr))
        out[f"unscoreable/{name}"] = float(torch.isnan(pool.lp_old[sel]).sum())  # empty/EOS-only
        for t, tname in enumerate(names):
            if t != k:
                out[f"omega/{name}->{tname}"] = float(ratios[k, t])
    out.update({f"reward_fn/{k}": float(v) for k, v in rstats.as_dict().items()
                if isinstance(v, (int, float))})
    out.update(retok.as_dict())
    return out


def engine_metrics(stats: dict) -> dict[str, float]:
    """A rollout engine's counters as metrics ``rollout/<key>``: numbers as they are, (nested)
    lists of numbers summed (e.g. vLLM's restarts per agent and engine); other entries (per-actor
    mappings) stay in ``engine.stats()`` only."""
    def total(v):
        if isinstance(v, bool):
            return None
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, (list, tuple)):
            parts = [total(x) for x in v]
            return None if any(p is None for p in parts) else float(sum(parts))
        return None

    out = {}
    for k, v in stats.items():
        t = total(v)
        if t is not None:
            out[f"rollout/{k}"] = t
    return out


def _view_tokens(view, name: str) -> dict[str, float]:
    """Tokens a learner scored in its updates, for self and cross samples: response tokens
    (``scored``) and response + prompt tokens per sample (``forward``: what whole-sequence
    forwards run; with prompt states each prompt is forwarded once per micro-batch block
    instead, counted in ``tokens/forward_prompt``)."""
    out = {}
    for part, sel in (("self", view.is_self), ("cross", ~view.is_self)):
        js = sel.nonzero().flatten().tolist()
        resp = sum(len(view.response_ids[j]) for j in js)
        out[f"tokens/scored_{part}/{name}"] = float(resp)
        out[f"tokens/forward_{part}/{name}"] = float(
            resp + sum(len(view.prompt_ids[j]) for j in js))
    return out


def _save(path, cfg, next_step, agents, tracker, sampler, engine, shuffle_gen, nonfinite, warm,
          before, ratio_log, inputs, heldout):
    ckpt.save_atomic({
        "step": next_step, "config": cfg.to_dict(), "fingerprint": fingerprint_dict(cfg),
        "agents": [{"name": name, **agents.state_dict(k)} for k, name in enumerate(agents.names)],
        "tracker": tracker.state_dict(), "sampler": sampler.state_dict(),
        "engine": engine.state_dict(), "shuffle_gen": shuffle_gen.get_state(),
        "nonfinite": dict(nonfinite), "warmup": warm, "eval_before": before,
        # tensors, not numpy arrays: the checkpoint loads with torch.load(weights_only=True)
        "ratio_hist": {key: torch.from_numpy(c.copy()) for key, c in ratio_log.items()},
        **inputs, "heldout": heldout}, path)


def _progress(cfg, start):
    if not cfg.progress or missing_feature(cfg, "progress") is not None:   # (train warned)
        return None
    from tqdm import tqdm
    return tqdm(total=cfg.steps, initial=start, desc="hacpo", unit="step", dynamic_ncols=True)


# default-on features a run goes on without where their package is missing (a warning, said
# once before any work): setting -> (the module it imports, what the run goes without)
OPTIONAL_FEATURES = {
    "tensorboard": ("torch.utils.tensorboard", "TensorBoard events (metrics.jsonl holds every "
                                               "row)"),
    "progress": ("tqdm", "a progress bar"),
}


def missing_feature(cfg: TrainConfig, setting: str) -> str | None:
    """Why the feature ``setting`` turns on (OPTIONAL_FEATURES) is left out of the run: its
    package is missing (one line: the package, how to install it, the setting that turns it
    off). None where it is off or its package imports."""
    if not getattr(cfg, setting):
        return None
    module, without = OPTIONAL_FEATURES[setting]
    try:
        importlib.import_module(module)
    except ImportError as e:
        return (missing_package(module, f"{setting}=true", e, f"or set {setting}=false")
                + f"; the run goes on without {without}")
    return None


def check_private_cluster(cfg: TrainConfig) -> None:
    """A run on a private Ray cluster (a setting that runs on Ray, no rollout.ray_address)
    needs a folder whose Ray socket paths fit an AF_UNIX path (TMPDIR, else /tmp): a
    ValueError now, not Ray's traceback after the warm-up."""
    on_ray = cfg.trainer_backend == "ray" or cfg.rollout.engine in ("ray", "vllm")
    if on_ray and not cfg.rollout.ray_address:
        from hacpo.launch.ray_cluster import temp_root
        temp_root()


def check_packages(cfg: TrainConfig) -> list[str]:
    """The optional packages the run's settings need, before any work: ray for the settings
    that run on it (a MissingPackageError naming the setting), and the notes of
    :func:`missing_feature` (the run goes on without those features)."""
    # the settings that run on Ray: an error now, not a traceback from the first `import ray`
    # after the warm-up
    for key, value in (("trainer_backend", cfg.trainer_backend),
                       ("rollout.engine", cfg.rollout.engine)):
        if value in ("ray", "vllm"):
            require_installed("ray", f"{key}={value}", f"or set {key}=local")
    return [note for setting in OPTIONAL_FEATURES
            if (note := missing_feature(cfg, setting)) is not None]
