"""Megatron-core trainer groups as Ray actors: ``agents.N.trainer = "megatron"`` (with
``trainer_backend = "ray"``).

Per agent one placement group of ``tp * pp * dp`` bundles and one :class:`MegatronRank` actor per
bundle (with ``rollout.colocate`` each bundle also holds one vLLM engine on the rank's GPU:
:meth:`MegatronAgents.engine_bundles`, hacpo/launch/vllm_rollout.py). The ranks form a
``torch.distributed`` world of their own (gloo on CPU, nccl with ``parallel.device = "cuda"``;
rank 0 opens the rendezvous store on an OS-picked port), run
``trainer_setup_hook`` first (a site hook, e.g. the CPU tests' CUDA->CPU patches of megatron-core),
then :func:`~hacpo.models.megatron.build.init_parallel`, build their shard with
:meth:`MegatronPolicy.from_state` from the HF config and the driver's cut of its HF policy's
weights (:func:`shard_refs`: one object per (tp, pp) shard, so no rank or node receives the
whole model; a resume ships weights, moved optimizer state and KL reference the same way) and
megatron's DDP + optimizer (AdamW,
eps 1e-8, the agent's lr / betas / weight decay for every parameter, as the torch trainer's
``torch.optim.AdamW``; with ``parallel.distributed_optimizer`` megatron's distributed
optimizer, which keeps each DP rank's slice of the Adam state only; fp16 weights train with
a constant loss scale of 1, i.e. unscaled, as the torch trainer's AdamW: a dynamic scaler's
overflow-skipped steps would differ from it and count as non-finite updates). The driver keeps its HF
:class:`~hacpo.models.policy.Policy` as the CPU copy that tokenizes, evaluates and feeds the
local and Ray rollout engines: :meth:`MegatronAgents.pull_weights` streams the shards back to
HF names into it after each update, ``parallel.weight_bucket_mb`` at a time
(``MegatronPolicy.hf_state_of_units``: rank 0 and the driver hold one bucket besides their own
weights). vLLM engines instead load the buckets rank 0 puts into the object store
(:meth:`MegatronAgents.publish_weights`), and the driver's copy is pulled from those only when
read (evaluation, checkpoints).

One update is :func:`hacpo.engine.update.update_learner`'s, split over the ranks:

- the driver cuts the learner's view into the M minibatches (``split_minibatches`` with the
  run's shuffle generator, which therefore advances exactly as in-process) and sends them;
- in every minibatch the self rows and the cross rows (each ordered by prompt, as in-process)
  are cut into ``dp`` contiguous shares, one per DP rank, and those into micro-batches of
  ``b`` rows (pad rows carry no loss), each padded only to its own longest row (at PP > 1 the
  stages exchange activation shapes); with ``parallel.micro_batch_tokens`` the shares are
  balanced by tokens instead and packed longest first into micro-batches of at most that many
  padded tokens (:mod:`hacpo.engine.batching`; DP ranks may then run different numbers of
  micro-batches, and the old log-probs are cut the same way); with
  ``parallel.sequence_parallel`` each row counts as its length rounded up to a multiple of tp
  (the positions the sequence-parallel forward runs); megatron-core's schedule runs
  them (1F1B at PP>1)
  with the minibatch's *global* divisor in :func:`~hacpo.engine.algorithm.learner_loss`, so the
  summed gradient is the whole minibatch's; only the response tokens are scored, their
  log-probs computed vocab-parallel (``parallel.lm_head``: "fused", the default, from the final
  hidden states and the output-layer shard in row chunks, no logits tensor; "logits" from
  megatron's output layer; see :mod:`hacpo.models.megatron.policy`; full logits are never
  gathered);
- the minibatch loss is summed over DP; with megatron's global grad norm every rank decides the
  same: a non-finite update is skipped (and the ranks stop at ``max_nonfinite`` in a row, where
  the driver raises :class:`~hacpo.engine.update.NonFiniteUpdateError`), otherwise gradients are
  clipped to ``grad_clip`` (coefficient ``grad_clip / (norm + 1e-6)``, as
  ``clip_grad_norm_``) and the optimizer steps;
- the driver computes the loss metrics per minibatch from the ranks' detached per-sample
  log-probs with update.py's own ``_minibatch_metrics``: same keys and meaning as in-process.

Old log-probs (the ratio's denominator) come from the same megatron shards, so the ratio is 1 at
m = 0 up to float rounding. Held-out evaluation runs on the driver's HF copy (same weights), or
with ``eval_engine = "rollout"`` on the rollout engines (e.g. vLLM; hacpo/engine/trainer.py).
The KL term (``loss.kl_coef > 0``, self samples only, as in-process): every rank also holds a
frozen shard of the initial (warm-started) weights, the reference policy; its token log-probs of
the agent's own samples are computed with the old log-probs (``time/ref_logprobs/<agent>``),
once per step, and the ranks add ``kl_coef * kl_numerator(low_var_kl) / divisor`` to the self rows'
loss (as update_learner does).
The reference never changes, so at the run's first save every rank writes its shard of it once
(``<out_dir>/checkpoint-megatron/<agent>/reference-<id>/rank-<i>.pt``, atomic) and every
checkpoint names those files with their sizes; a resumed run's ranks read their own shard (a
missing or resized file is a clear error) and its later checkpoints name the same files.
Checkpoints from before carry the reference's HF weights (``megatron.ref_hf``) and still
resume. The reference doubles the ranks' parameter memory (no offload).

Stage times (``time/<stage>/<agent>``) are the reporting rank's (DP 0, TP 0, last PP stage):
``score_self`` / ``score_cross``: its forward + log-prob + loss time of self / cross
micro-batches; ``backward_self`` / ``backward_cross``: the rest of megatron's
forward-backward schedule (backward, pipeline communication, the DP gradient all-reduce), which
is not separable per part, apportioned to the parts in proportion to their forward times;
``optimizer``: loss all-reduce, grad norm, clip and step. ``score_prompt`` /
``backward_prompt`` stay 0 (no prompt sharing here).

Agents with ``trainer = "torch"`` may share the run: each trains in a
:class:`~hacpo.launch.ray_trainer.TrainerActor`, called exactly as ``RayAgents`` calls it.

Actors are not restarted: a dead rank is a clear error naming its agent and rank, and the run
continues from its last checkpoint with ``--resume``. A checkpoint holds the full HF-named
weights (the driver's copy) and the layout (tp, pp, dp, transformer_impl, vocabulary padding,
distributed optimizer) the optimizer state belongs to. A resume may change tp / pp / dp and
turn the distributed optimizer on or off: the shards name their parameters (and the
distributed optimizer's the slice each DP rank holds), and the driver gathers Adam's moments
(with the fp32 main weights of bf16 / fp16 weights) to HF names (:func:`moments_of_shards`:
from DP rank 0 of every (tp, pp) shard, or the slices of all its DP ranks joined; the moments
move as the weights do), which each new rank cuts for itself
(``MegatronPolicy.load_named_moments``, a slice of it with the distributed optimizer); the KL
reference's shards likewise (:func:`weights_of_shards`, written anew at the next save). Any
other layout change, or shards that name no parameters (written before they did), is an
error. Otherwise the optimizer state never passes through the driver: every rank writes its
own shard (with the distributed optimizer, its slice: ``MegatronPolicy.optimizer_state``)
(``<out_dir>/checkpoint-megatron/<agent>/<save id>/rank-<i>.pt``, each file atomic and
fsynced) and the checkpoint names the files; on resume each rank reads its own. The driver
checks that it sees every file with the size the rank wrote (out_dir must be on a filesystem
shared by the nodes; otherwise a clear error, before the checkpoint is written). The
checkpoint file is written after all shards, so a crash leaves the previous checkpoint whole
with its shards; shard directories of other saves are deleted once a checkpoint naming newer
ones is on disk, and those a resumed checkpoint does not name once it is loaded (a crash after
a save's rename leaves the previous save's, which a resume that saves no more would keep).
Checkpoints from before this layout (optimizer states inside the file) still
resume.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import math
import os
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

# first: its environment must precede `import ray`
from .ray_cluster import COLOCATED_GPU_SHARE, RayCluster, connect, weight_bytes

import ray  # noqa: E402
import torch
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hacpo.engine import checkpoint as ckpt
from hacpo.engine.algorithm import learner_loss, split_minibatches
from hacpo.engine.batching import balanced_shares, pack_micro_batches
from hacpo.engine.agents import score_temperature
from hacpo.engine.evaluate import evaluate_policy
from hacpo.engine.losses import kl_numerator, low_var_kl
from hacpo.engine.pool import LearnerView, StepPool, scored_lengths
from hacpo.engine.rollout import agents_at_once
from hacpo.engine.timing import device_sync
from hacpo.engine.errors import user_errors
from hacpo.engine.run_config import colocated_engines, gpu_needs, rollout_cpus, trainer_cpus
from hacpo.engine.update import (UpdateMetrics, _count_nonfinite as count_nonfinite,
                                 _minibatch_metrics, _pad, agent_streak)
from hacpo.models.buckets import (bucket_bytes_of, check_bucket_shapes, copy_buckets,
                                  plan_buckets)
from hacpo.models.policy import Policy

from .ray_trainer import (TrainerActor, actor_update, draw_minibatches,
                          drawn_update_result)

log = logging.getLogger("hacpo")


def load_setup_hook(spec: str, where: str):
    """The function a ``"module:function"`` spec names (its module imported); a spec that
    cannot be loaded is a RuntimeError naming it and ``where`` it was loaded."""
    mod, _, fn = spec.partition(":")
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"trainer_setup_hook {spec!r} cannot be loaded {where}: "
                           f"{type(e).__name__}: {e}") from e
    if not callable(f):
        raise RuntimeError(f"trainer_setup_hook {spec!r} names a {type(f).__name__}, not a "
                           f"function")
    return f


def run_setup_hook(spec: str) -> None:
    """Import ``module`` and call ``function()`` for a ``"module:function"`` spec."""
    load_setup_hook(spec, "in the trainer rank process")()


def check_driver_setup(cfg) -> None:
    """What every rank would otherwise fail on only after Ray started, each rank with a long
    traceback, checked in the driver (whose Python a local cluster's ranks run; a joined
    cluster's nodes should match it): ``trainer_setup_hook`` loads (its module imports here and
    has the function; it is not called), and an agent with
    ``parallel.transformer_impl=transformer_engine`` (on cuda: the config refuses it on cpu)
    finds transformer_engine installed."""
    if cfg.trainer_setup_hook:
        load_setup_hook(cfg.trainer_setup_hook, "in the driver (the ranks import it the same "
                                                "way)")
    for a in cfg.agents:
        if (a.trainer == "megatron" and a.parallel.transformer_impl == "transformer_engine"
                and importlib.util.find_spec("transformer_engine") is None):
            raise RuntimeError(f"agent {a.policy.name!r}: parallel.transformer_impl="
                               f"'transformer_engine' but transformer_engine is not importable "
                               f"here; install it (CUDA only) or set "
                               f"parallel.transformer_impl=local")


def _pack(prompts: list[list[int]], resps: list[list[int]], b: int, S: int):
    """Rows prompt+response right-padded into ``ids`` / ``targets`` (ids shifted by one) [b, S],
    plus the positions ``pos`` [b, T] predicting each response token and their mask [b, T]
    (rows past ``len(prompts)`` are padding)."""
    T = max([len(r) for r in resps] + [1])
    ids = torch.zeros(b, S, dtype=torch.long)
    targets = torch.zeros(b, S, dtype=torch.long)
    pos = torch.zeros(b, T, dtype=torch.long)
    mask = torch.zeros(b, T, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, resps)):
        seq = torch.tensor(list(p) + list(r), dtype=torch.long)
        ids[i, :len(seq)] = seq
        targets[i, :len(seq) - 1] = seq[1:]
        pos[i, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[i, :len(r)] = True
    return ids, targets, pos, mask


def check_shards_visible(written: list[dict], what: str) -> None:
    """Every file the ranks wrote ({"path", "bytes"}) must be visible here with that size:
    otherwise out_dir is not shared with the ranks' nodes (or the file changed), and a
    checkpoint naming it could not be resumed: a clear error before it is written."""
    for i, w in enumerate(written):
        seen = os.path.getsize(w["path"]) if os.path.isfile(w["path"]) else None
        if seen != w["bytes"]:
            raise RuntimeError(
                f"{what}: rank {i} wrote its optimizer shard {w['path']} ({w['bytes']} bytes) "
                f"but the driver sees {'no such file' if seen is None else f'{seen} bytes'}: "
                f"out_dir must be on a filesystem shared by every node of the run")


def check_named_shards(files: list[dict], out_dir: str, ranks: int, agent: str,
                       kind: str) -> list[str]:
    """On resume: the shard files a checkpoint names ({"path" relative to out_dir, "bytes": the
    size its rank wrote, or None where an older checkpoint did not record it}) must be one per
    rank and present with that size; returns their full paths, else a clear error naming each
    file that is missing or changed (a half-copied run, or checkpoint.pt moved without
    checkpoint-megatron/)."""
    if len(files) != ranks:
        raise ValueError(f"agent {agent!r}: the checkpoint names {len(files)} {kind} shards "
                         f"for {ranks} ranks")
    bad, paths = [], []
    for f in files:
        path = os.path.join(out_dir, f["path"])
        seen = os.path.getsize(path) if os.path.isfile(path) else None
        if seen is None or (f["bytes"] is not None and seen != f["bytes"]):
            bad.append(f"{f['path']} (" + ("missing" if seen is None else
                                           f"{seen} bytes, written with {f['bytes']}") + ")")
        paths.append(path)
    if bad:
        raise ValueError(f"agent {agent!r}: the checkpoint's {kind} shards are missing or "
                         f"changed: {', '.join(bad)}; keep checkpoint-megatron/ next to "
                         f"checkpoint.pt")
    return paths


MOVABLE_LAYOUT = ("tp", "pp", "dp", "distributed_optimizer")   # a resume may change these


def rank_coords(i: int, tp: int, dp: int) -> tuple[int, int, int]:
    """Group rank i's (tp_rank, pp_rank, dp_rank): megatron's default order, TP fastest, then
    DP, then PP (checked against what every rank reports when the group starts)."""
    return i % tp, i // (tp * dp), (i // tp) % dp


def shard_refs(cut, tp: int, pp: int, dp: int) -> list:
    """One object-store ref per rank of a tp x pp x dp group (in rank order): ``cut(tp_rank,
    pp_rank)`` put once per (tp, pp) shard and shared by that shard's DP ranks, so a rank (and
    its node) fetches only its own shard, never the whole model; the driver holds one cut at a
    time besides what it cuts from."""
    refs: dict[tuple[int, int], Any] = {}
    out = []
    for i in range(tp * pp * dp):
        tp_rank, pp_rank, _ = rank_coords(i, tp, dp)
        if (tp_rank, pp_rank) not in refs:
            refs[tp_rank, pp_rank] = ray.put(cut(tp_rank, pp_rank))
        out.append(refs[tp_rank, pp_rank])
    return out


# an agent with no samples this step: the update's metrics (the same keys every step)
_NO_UPDATE = {"trained_samples": 0.0, "trained_self": 0.0, "trained_cross": 0.0,
              "tokens_update_padded": 0.0, "update_micro_batches": 0.0}


def rank_bundles(par, threads: int, engines: int = 0) -> list[dict[str, float]]:
    """The placement-group bundles of a megatron group's ``par.world`` ranks: ``threads`` CPUs
    each and, on ``parallel.device=cuda``, one GPU; the first ``engines`` bundles also hold a
    colocated vLLM engine (``rollout.colocate``: one CPU more; the engine and the rank take
    half of the bundle's GPU each, ``COLOCATED_GPU_SHARE``)."""
    if engines > par.world:
        raise ValueError(f"{engines} colocated engines for {par.world} trainer ranks")
    gpu = {"GPU": 1} if par.device == "cuda" else {}
    return [{"CPU": threads + (r < engines), **gpu} for r in range(par.world)]


def moments_of_shards(files: list[str], old: dict, arch_of, agent: str):
    """Adam's state in a checkpoint's optimizer shards (one file per rank of layout ``old``,
    {"tp", "pp", "dp", "transformer_impl", "distributed_optimizer", ...}) as (step, {moment:
    HF-named full tensors}, loss scaler states), from DP rank 0 of every (tp, pp) shard, or
    with the distributed optimizer the slices of all its DP ranks joined: what a resume with
    another layout cuts for its own ranks. ``arch_of``: the model's ArchSpec."""
    from hacpo.models.megatron.policy import grad_scaler_states, moments_of_layout, named_moments

    tp, pp, dp = old["tp"], old["pp"], old["dp"]
    sliced = bool(old.get("distributed_optimizer"))
    named, scalers = [], None
    for i, path in enumerate(files):
        coords = rank_coords(i, tp, dp)
        if coords[2] and not sliced:        # the plain optimizer's DP replicas: the same
            continue
        state = ckpt.load(path)
        states = named_moments(state)
        if states is None:
            raise ValueError(f"agent {agent!r}: the checkpoint's optimizer shards name no "
                             f"parameters (written before they did), so they cannot move to "
                             f"another layout: resume with the checkpoint's {old}")
        if i == 0:
            scalers = grad_scaler_states(state)
        named.append((coords, states))
        del state
    try:
        step, hf = moments_of_layout(named, tp, pp, sliced=sliced, arch=arch_of,
                                     transformer_impl=old["transformer_impl"])
    except ValueError as e:
        raise ValueError(f"agent {agent!r}: the checkpoint's optimizer shards cannot move to "
                         f"another layout: {e}") from None
    return step, hf, scalers


def weights_of_shards(files: list[str], old: dict, arch_of) -> dict[str, torch.Tensor]:
    """A checkpoint's per-rank megatron weight shards (the KL reference's, layout ``old``) ->
    full HF-named weights (DP rank 0 of every (tp, pp) shard)."""
    from hacpo.models.megatron import megatron_to_hf

    tp, dp = old["tp"], old["dp"]
    shards = [[None] * tp for _ in range(old["pp"])]
    for i, path in enumerate(files):
        tp_rank, pp_rank, dp_rank = rank_coords(i, tp, dp)
        if not dp_rank:
            shards[pp_rank][tp_rank] = ckpt.load(path)
    return megatron_to_hf(shards, arch_of, transformer_impl=old["transformer_impl"])


def _built(config, optimizer) -> str:
    """What a rank's megatron model and optimizer were built with, from its TransformerConfig
    and optimizer classes (logged)."""
    from hacpo.models.megatron.policy import chained

    rc = config.recompute_granularity
    recompute = ("none" if rc is None else
                 f"selective:{','.join(config.recompute_modules)}" if rc == "selective" else
                 f"full:{config.recompute_num_layers}")
    return (f"transformer_impl={config.transformer_impl} "
            f"sequence_parallel={config.sequence_parallel} recompute={recompute} optimizer="
            + "+".join(type(o).__name__ for o in chained(optimizer)))


class MegatronRank:
    """One rank of an agent's megatron trainer group: its shard of the policy and optimizer."""

    def __init__(self, agent: str, rank: int, world: int, threads: int, setup_hook: str):
        torch.set_num_threads(threads)
        self.agent, self.rank, self.world = agent, rank, world
        if setup_hook:
            run_setup_hook(setup_hook)
        self.pol = None
        self._sync = None         # profile_sync on CUDA: torch.cuda.synchronize (see _now)

    def _now(self) -> float:
        """The clock of this rank's stage times: with ``profile_sync`` on CUDA the device is
        synchronized first, so a stage's time includes its kernels, not only their launch
        (otherwise the split between stages is what the host saw; their sum is exact, an
        update ends with a host sync)."""
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    def ready(self) -> int:
        return os.getpid()

    def rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: open the group's TCP store on a port the OS picks (no race for a free
        port); returns (this node's address, that port)."""
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, self.world, is_master=True,
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return host, self._store.port

    def setup(self, addr: tuple[str, int], hf_config, dtype: torch.dtype,
              shard: dict[str, torch.Tensor], par: dict, optim: dict, seed: int,
              timeout_s: float, reference: bool = False) -> dict:
        """Join the group, build this rank's shard of the model (``hf_config``, weights of
        ``dtype``) from ``shard`` (the driver's cut of its weights for this rank's tp / pp
        ranks, megatron names: a rank never receives the whole model) and its optimizer (and,
        with ``reference``, a frozen shard of the same initial weights: the KL term's reference
        policy); returns its layout."""
        import torch.distributed as dist

        from hacpo.models.megatron import MegatronPolicy, init_parallel

        self.device = torch.device(par["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(0)          # Ray shows each rank its own GPU
        timeout = timedelta(seconds=timeout_s)
        store = self._store if self.rank == 0 else dist.TCPStore(
            addr[0], addr[1], self.world, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=store,
                                rank=self.rank, world_size=self.world, timeout=timeout)
        p = init_parallel(par["tp"], par["pp"], par["dp"], seed=seed)
        self.par = p
        build = dict(transformer_impl=par["transformer_impl"], params_dtype=dtype,
                     make_vocab_size_divisible_by=par["make_vocab_size_divisible_by"],
                     lm_head=par["lm_head"], sequence_parallel=par["sequence_parallel"],
                     recompute=par["recompute_kw"])
        self.pol = MegatronPolicy.from_state(hf_config, shard, p, **build)
        self.ref = None
        if reference:
            self.ref = MegatronPolicy.from_state(hf_config, shard, p, **build)
            self.ref.module.requires_grad_(False)
            self.ref.model.eval()
        if self.device.type == "cuda":
            self.pol.model.cuda()
            if self.ref is not None:
                self.ref.model.cuda()
        self.opt = self.pol.build_optimizer(lr=optim["lr"], weight_decay=optim["weight_decay"],
                                            adam_beta1=optim["beta1"], adam_beta2=optim["beta2"],
                                            adam_eps=1e-8, clip_grad=0.0,
                                            use_distributed_optimizer=par["distributed_optimizer"],
                                            # fp16: no loss scaling, as the torch trainer's
                                            # AdamW (a dynamic scaler's overflow skips would
                                            # count as non-finite updates)
                                            loss_scale=1.0 if dtype == torch.float16 else None)
        self.grad_clip = optim["grad_clip"]
        # rollout.colocate: after an update, torch's cached GPU blocks go back to the GPU for
        # the vLLM engine that shares it
        self.release_cache = self.device.type == "cuda" and par.get("release_cache", False)
        self._sync = device_sync(par.get("profile_sync", False) and self.device.type == "cuda")
        self.reporter = p.last_stage and p.tp_rank == 0      # holds per-sample results
        return {"rank": self.rank, "tp_rank": p.tp_rank, "pp_rank": p.pp_rank,
                "dp_rank": p.dp_rank, "pid": os.getpid(),
                "built": _built(self.pol.module.config, self.opt)}

    # -- old log-probs --------------------------------------------------------------------------
    def old_logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                     micro_batch: int, temperature: float,
                     micro_batch_tokens: int = 0) -> dict | None:
        """Token log-probs of this DP rank's share of the rows (responses already cut to their
        scored part, none empty; a contiguous share, or with ``micro_batch_tokens`` one
        balanced by tokens and packed by that budget), from the TP 0 / PP 0 rank of each DP
        replica (None elsewhere): {"rows": the share's row indices, "toks": [token_logp of each
        of those rows], "seconds"}, plus with a reference shard the reference policy's
        ("ref_toks", "ref_seconds"): the rows are the agent's own samples, exactly the ones the
        KL term covers, and the reference is frozen, so they are computed once per step
        here."""
        p, n = self.par, len(prompts)
        if micro_batch_tokens:
            rows = balanced_shares([self.pol.padded_length(len(a) + len(r))
                                    for a, r in zip(prompts, responses)], p.dp)[p.dp_rank]
        else:
            rows = list(range(p.dp_rank * n // p.dp, (p.dp_rank + 1) * n // p.dp))
        out = {"rows": rows}
        for key, pol in (("", self.pol), ("ref_", self.ref)):
            if pol is None:
                continue
            t = self._now()
            toks: list[torch.Tensor] = []
            if rows:        # one pipelined schedule; each micro-batch cut to its longest row
                ps_, rs = [prompts[i] for i in rows], [responses[i] for i in rows]
                S = max(len(a) + len(b) for a, b in zip(ps_, rs))
                ids, targets, pos, mask = _pack(ps_, rs, len(ps_), S)
                tl = pol.token_logprobs(ids.to(self.device), targets.to(self.device),
                                        positions=pos, mask=mask, temperature=temperature,
                                        micro_batch_size=micro_batch,
                                        micro_batch_tokens=micro_batch_tokens or None).cpu()
                toks = [tl[i, :len(r)].clone() for i, r in enumerate(rs)]
            out[f"{key}toks"], out[f"{key}seconds"] = toks, self._now() - t
        if p.tp_rank != 0 or p.pp_rank != 0:
            return None
        return out

    # -- one learner update ---------------------------------------------------------------------
    def update(self, req: dict) -> list[dict] | dict:
        """The minibatch updates of ``req`` (see the module docstring). Returns per minibatch
        {"finite", "loss", "grad_norm", "new_lp": {row: mean log-prob}, "tl": {row: token
        log-probs}, "kl": {self row: KL}} (samples only on the reporting ranks) and the stage
        seconds."""
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        started = time.time()
        algo, view, p = req["algo"], req["view"], self.par
        is_self = view.is_self.tolist()
        streak, out = req["streak"], []
        times = defaultdict(float)
        fb = get_forward_backward_func()

        def key(j):
            return (len(view.prompt_ids[j]), tuple(view.prompt_ids[j]), len(view.response_ids[j]))

        budget = req["micro_batch_tokens"]
        # each row's positions in the forward (rounded up to a multiple of tp under sequence
        # parallelism): what shares, budgets and micro-batch widths count
        lens = [self.pol.padded_length(len(a) + len(r))
                for a, r in zip(view.prompt_ids, view.response_ids)]
        n_micro = n_padded = 0

        for m, mb_list in enumerate(req["minibatches"]):
            if algo.token_level:
                divisor = sum(len(view.response_ids[j]) for j in mb_list)
            else:
                divisor = len(mb_list)
            parts = {part: sorted((j for j in mb_list if is_self[j] == (part == "self")),
                                  key=key) for part in ("self", "cross")}
            if budget:      # token-balanced DP shares, packed longest first (batching.py)
                groups = {part: pack_micro_batches(
                    lens, budget, req["micro_batch"], balanced_shares(lens, p.dp, rows)[p.dp_rank])
                    for part, rows in parts.items()}
            else:           # contiguous DP shares, micro-batches of b rows (pad rows: no loss)
                shares = {part: [rows[d * len(rows) // p.dp:(d + 1) * len(rows) // p.dp]
                                 for d in range(p.dp)] for part, rows in parts.items()}
                b = max(1, min(req["micro_batch"],
                               max(len(s) for sh in shares.values() for s in sh)))
                groups = {part: [sh[p.dp_rank][s:s + b]
                                 for s in range(0, len(sh[p.dp_rank]), b)]
                          for part, sh in shares.items()}
            micro = []
            for part in ("self", "cross"):
                for js in groups[part]:
                    # padded to this micro-batch's longest row only (shapes may differ)
                    micro.append((part, js, _pack([view.prompt_ids[j] for j in js],
                                                  [view.response_ids[j] for j in js],
                                                  len(js) if budget else b,
                                                  max(lens[j] for j in js))))
            if not micro:                     # no rows here: one pad micro-batch keeps the
                micro.append(("self", [], _pack([], [], 1, 1)))   # schedule and DP in step
            S = max(m[2][0].shape[1] for m in micro)
            b_max = max(m[2][0].shape[0] for m in micro)
            n_micro += len(micro)
            n_padded += sum(m[2][0].numel() for m in micro)
            ctx = {"total": torch.zeros((), device=self.device), "fwd": defaultdict(float),
                   "new_lp": {}, "tl": {}, "kl": {}}

            def forward_step(data_iterator, model, m=m, divisor=divisor, ctx=ctx):
                part, js, (ids, targets, pos, mask) = next(data_iterator)
                t0 = self._now()
                ids, targets = ids.to(self.device), targets.to(self.device)
                output = self.pol.forward(model, ids)   # last stage: hidden states or logits
                ctx["fwd"][part] += self._now() - t0

                def loss_func(output):
                    t1 = self._now()
                    loss = self._loss(output, targets, pos, mask, part, js, m, divisor, req, ctx)
                    ctx["fwd"][part] += self._now() - t1
                    return loss, torch.ones((), dtype=torch.int), {}
                return output, loss_func

            self.pol.model.train()
            self.pol.model.zero_grad_buffer()
            self.opt.zero_grad()
            t0 = self._now()
            fb(forward_step_func=forward_step, data_iterator=iter(micro), model=[self.pol.model],
               num_microbatches=len(micro), seq_length=S, micro_batch_size=b_max,
               forward_only=False)
            sched = self._now() - t0
            self.pol.model.eval()
            t0 = self._now()
            total = ctx["total"].detach().float().reshape(1).clone()
            if p.last_stage and p.dp > 1:
                dist.all_reduce(total, group=p.dp_group)
            if p.pp > 1:
                dist.broadcast(total, src=dist.get_global_rank(p.pp_group, p.pp - 1),
                               group=p.pp_group)
            loss = float(total.item())
            self.opt.prepare_grads()          # main_grad -> grad (DP-reduced by the schedule)
            gnorm = float(self.opt.get_grad_norm())
            finite = math.isfinite(loss) and math.isfinite(gnorm)
            if finite:
                coef = self.grad_clip / (gnorm + 1e-6)     # as clip_grad_norm_ (and megatron's
                if self.grad_clip > 0 and coef < 1:         # CUDA-only clip_grad_by_total_norm)
                    from hacpo.models.megatron.policy import chained

                    with torch.no_grad():
                        for o in chained(self.opt):
                            for prm in o.get_parameters():
                                if prm.grad is not None:
                                    prm.grad.mul_(coef)
                self.opt.step_with_ready_grads()
            times["optimizer"] += self._now() - t0
            fwd = ctx["fwd"]
            back = max(0.0, sched - fwd["self"] - fwd["cross"])
            f_all = fwd["self"] + fwd["cross"]
            for part in ("self", "cross"):
                times[f"score_{part}"] += fwd[part]
                times[f"backward_{part}"] += back * (fwd[part] / f_all if f_all > 0 else 0.5)
            out.append({"finite": finite, "loss": loss, "grad_norm": gnorm,
                        **{key: ctx[key] if self.reporter else {}
                           for key in ("new_lp", "tl", "kl")}})
            if finite:
                streak = 0
            else:
                self.opt.zero_grad()
                streak += 1
                if streak >= req["max_nonfinite"]:
                    break
        if self.release_cache:     # colocated: the engine on this GPU wakes up next
            torch.cuda.empty_cache()
        return {"minibatches": out, "times": dict(times), "micro_batches": n_micro,
                "padded_tokens": n_padded, "dp_rank": p.dp_rank, "reporter": self.reporter,
                "span": (started, time.time())}    # wall clock: agents' updates overlap

    def _loss(self, output, targets, pos, mask, part, js, m, divisor, req, ctx):
        """learner_loss of a micro-batch's real rows (the first ``len(js)``) with the
        minibatch's global divisor; detached per-sample values go to ``ctx``."""
        # the response tokens' log-probs [b, T] (0 past each response and in pad rows)
        lp = self.pol.logprobs_at(output, targets, pos, mask, req["temperature"])
        r = len(js)
        if r == 0:
            return lp.sum() * 0.0
        algo, view = req["algo"], req["view"]
        msk = mask[:r].to(lp.device)
        tl = lp[:r]
        new_lp = tl.sum(-1) / msk.sum(-1)
        pool_idx = view.idx[js]
        kwargs = {}
        if algo.token_level:
            kwargs = dict(token_logp=tl, mask=msk, old_token_logp=_pad(
                [req["old_token_logp"][i] for i in pool_idx.tolist()], tl.shape[1]).to(lp.device))
        dev = lp.device
        loss, _ = learner_loss(algo, new_lp=new_lp, old_lp=req["lp_old"][pool_idx].to(dev),
                               advantages=view.advantages[js].to(dev),
                               is_self=view.is_self[js].to(dev), omega=view.omega[js].to(dev),
                               minibatch_index=m, divisor=divisor, **kwargs)
        if part == "self" and req["kl_coef"] > 0:       # update_learner's KL term
            ref = _pad([req["ref_token_logp"][i] for i in pool_idx.tolist()],
                       tl.shape[1]).to(dev)
            kl = low_var_kl(tl, ref, msk)
            loss = loss + req["kl_coef"] * kl_numerator(kl, msk, algo.token_level) / divisor
            kl_cpu = kl.detach().cpu()                   # one device-to-host copy each
            for i, j in enumerate(js):
                ctx["kl"][j] = kl_cpu[i]
        ctx["total"] = ctx["total"] + loss.detach()
        new_cpu = new_lp.detach().cpu()
        tl_cpu = tl.detach().cpu() if algo.token_level else None
        for i, j in enumerate(js):
            ctx["new_lp"][j] = new_cpu[i]
            if tl_cpu is not None:
                ctx["tl"][j] = tl_cpu[i, :len(view.response_ids[j])].clone()
        return loss

    # -- weights and checkpoints ----------------------------------------------------------------
    def hf_weights_put(self, units: list) -> list | None:
        """As :meth:`hf_weights` (a collective of the group), but rank 0 puts its bucket into
        the object store and returns ``[ref, {name: shape}]`` (a list: Ray does not resolve
        the ref), so the weights reach the rollout engines without passing through the
        driver, which checks the names and shapes."""
        sd = self.hf_weights(units)
        return None if sd is None else [ray.put(sd), {n: tuple(t.shape) for n, t in sd.items()}]

    def hf_weights(self, units: list | None = None) -> dict[str, torch.Tensor] | None:
        """The policy's HF-named weights of ``units`` (None: all), a collective of the group:
        on rank 0, None elsewhere (no rank holds more than its shard and these units; see
        ``MegatronPolicy.hf_state_of_units``)."""
        from hacpo.models.megatron import hf_units

        pol = self.pol
        sd = pol.hf_state_of_units(hf_units(pol.arch) if units is None else
                                   [tuple(u) for u in units])
        return {k: v.detach().cpu().clone() for k, v in sd.items()} if sd is not None else None

    def save_optim(self, path: str) -> dict:
        """Write this rank's optimizer state to ``path`` (atomic, fsynced) on this node's
        filesystem (with the distributed optimizer: its slice); returns {"path", "bytes"} for
        the driver to check."""
        ckpt.save_atomic(self.pol.optimizer_state(self.opt), path)
        return {"path": path, "bytes": os.path.getsize(path)}

    def save_reference(self, path: str) -> dict:
        """Write this rank's shard of the frozen KL reference (megatron names, on the host) to
        ``path`` (atomic, fsynced); returns {"path", "bytes"}."""
        if self.ref is None:
            raise RuntimeError(f"agent {self.agent!r}: this group has no reference policy")
        ckpt.save_atomic({k: v.cpu() for k, v in self.ref.local_state().items()}, path)
        return {"path": path, "bytes": os.path.getsize(path)}

    def load(self, weights: dict[str, torch.Tensor], optim_state: dict | str,
             ref: dict[str, torch.Tensor] | str | None = None) -> int:
        """Load this rank's shard of the weights (megatron names, cut by the driver), this
        rank's optimizer state (a state dict, the path of the file :meth:`save_optim` wrote, or
        ``{"moved": ..., "grad_scalers": ...}``: the per-parameter state of another layout cut
        for this rank by the driver) and, with a reference shard, the reference: its shard
        (megatron names), or the path of this rank's shard file (:meth:`save_reference`)."""
        from hacpo.models.megatron import load_megatron_state

        for pol, state in ((self.pol, weights), (self.ref, ref)):
            if pol is None:
                continue
            if state is None:
                raise ValueError(f"agent {self.agent!r}: no reference weights to load")
            if isinstance(state, str):          # this rank's shard, as save_reference wrote it
                state = ckpt.load(state)
            with torch.no_grad():
                load_megatron_state(pol.module, {k: v.to(self.device) for k, v in state.items()})
        if isinstance(optim_state, str):
            optim_state = ckpt.load(optim_state)
        if "moved" in optim_state:           # from another layout: this rank's cut of it
            if optim_state["moved"]:              # (none: no update had run, a fresh state)
                self.pol.load_named_moments(self.opt, optim_state["moved"],
                                            grad_scalers=optim_state.get("grad_scalers"))
        else:
            self.pol.load_optimizer_state(self.opt, optim_state)
        return os.getpid()

    def close(self) -> int:
        import torch.distributed as dist
        if self.pol is not None:
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        return os.getpid()


class _Group:
    """Driver-side handle of one agent's ranks (``par`` None: a trainer=torch agent, whose one
    "rank" is a :class:`~hacpo.launch.ray_trainer.TrainerActor`)."""

    def __init__(self, name: str, par, pg, ranks: list):
        self.name, self.par, self.pg, self.ranks = name, par, pg, ranks
        self.layout: list[dict] = []

    @property
    def torch(self) -> bool:
        return self.par is None


class MegatronAgents:
    """The agent group over megatron trainer groups (see the module docstring); the same
    methods as :class:`hacpo.engine.agents.LocalAgents`. Agents with ``trainer = "torch"`` in
    the same run train in a :class:`~hacpo.launch.ray_trainer.TrainerActor` each, called as
    :class:`~hacpo.launch.ray_trainer.RayAgents` calls it.

    Args:
        cfg: the TrainConfig (``trainer_backend = "ray"``).
        policies: the driver's HF policies (warm-started): the ranks' initial weights, kept as
            the driver's CPU copy.
        timeout_s: how long to wait for the cluster and the placement groups.
        start_timeout_s: how long the rank actors may take to start and build their shards.
    """

    def __init__(self, cfg, policies: list[Policy], *, timeout_s: float = 60.0,
                 start_timeout_s: float = 300.0):
        from hacpo.models.megatron.build import check_megatron_policy

        self.cfg = cfg
        # absolute: the rank actors' working directory is not the driver's
        self.out_dir = os.path.abspath(cfg.out_dir)
        self.policies = list(policies)
        self.names = [p.name for p in policies]
        self.threads = cfg.threads if cfg.threads > 0 else 1
        for a, pol in zip(cfg.agents, policies):
            if a.trainer != "megatron":
                if pol.output_weight.device.type != "cpu":
                    raise ValueError(f"trainer_backend=ray trains trainer=torch agents on CPU "
                                     f"actors, but policy {pol.name!r} is on "
                                     f"{pol.output_weight.device}")
                continue
            if pol.kind != "hf" or pol.output_weight.device.type != "cpu":
                raise ValueError(f"agent {pol.name!r} (trainer=megatron) needs an HF policy "
                                 f"held on the driver's CPU, got kind={pol.kind!r} on "
                                 f"{pol.output_weight.device}")
            check_megatron_policy(pol, a.parallel)    # checked before the warm-up too
        self._groups: list[_Group] = []
        self._closed = False
        # the KL term: each group holds a frozen reference shard; its token log-probs of the
        # agent's own samples come with the old log-probs, once per step
        self.kl = cfg.algorithm.loss.kl_coef > 0
        self._ref_tl: list[dict[int, torch.Tensor]] = [{} for _ in policies]
        self.weight_buckets = [0] * len(policies)     # buckets of each agent's last pull
        # optimizer shards each megatron agent's ranks wrote for the checkpoint being saved
        # (a directory under shard_root(k)); checkpoint_saved() keeps only those
        self._shard_dirs: list[str | None] = [None] * len(policies)
        # the KL reference is frozen: its shards are written once per run (first save, or
        # named by the checkpoint a run resumed from) and every later checkpoint names them
        self._ref_files: list[list[dict] | None] = [None] * len(policies)
        # the driver's policy is behind its ranks (an update since its last pull), and the
        # buckets publish_weights put for the ranks' current weights (None: not published)
        self._stale = [False] * len(policies)
        self._published: list[list | None] = [None] * len(policies)
        self.cluster: RayCluster | None = None
        check_driver_setup(cfg)           # before Ray: not as a traceback from every rank
        worlds = [a.parallel.world if a.trainer == "megatron" else 1 for a in cfg.agents]
        need = trainer_cpus(cfg)          # the ranks' threads + colocated engines' CPU
        self.cluster = connect(cfg.rollout.ray_address, timeout_s=timeout_s,
                               num_cpus=max(need + rollout_cpus(cfg), os.cpu_count() or 1),
                               weights=weight_bytes(policies))
        try:
            with user_errors(RuntimeError):   # a cluster too small: not the code's to fix
                self.cluster.require(
                    "CPU", need,
                    what=f"the megatron trainer groups need {need} CPUs "
                         f"({'+'.join(map(str, worlds))} ranks x {self.threads} CPU each, "
                         f"threads={cfg.threads}"
                         + (f"; {colocated_engines(cfg)} colocated vLLM engines x 1"
                            if colocated_engines(cfg) else "") + ")",
                    hint="lower threads, tp/pp/dp, or add nodes")
                self._require_gpus()
            self._start(timeout_s, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _require_gpus(self) -> None:
        """One GPU per rank on ``parallel.device=cuda`` (a colocated engine shares its rank's),
        checked before any placement group is asked for: a group the cluster cannot grant
        would wait for GPUs until the reserve timeout, then blame CPUs."""
        cuda = [(a.policy.name, a.parallel.world) for a in self.cfg.agents
                if a.trainer == "megatron" and a.parallel.device == "cuda"]
        if not cuda:
            return
        need = gpu_needs(self.cfg)[0]
        self.cluster.require(
            "GPU", need,
            what=f"parallel.device='cuda': the megatron trainer ranks need {need} GPUs ("
                 + ", ".join(f"{name}: {world}" for name, world in cuda) + " ranks x 1 GPU)",
            hint="lower tp/pp/dp, set parallel.device=cpu, or add GPUs")

    def _start(self, timeout_s: float, start_timeout_s: float) -> None:
        cfg = self.cfg
        remote_cls = ray.remote(MegatronRank)
        for k, (a, pol) in enumerate(zip(cfg.agents, self.policies)):
            if a.trainer != "megatron":           # as RayAgents: one TrainerActor
                pg = self.cluster.reserve(
                    [{"CPU": self.threads}], timeout_s=timeout_s,
                    what=f"agent {pol.name!r}: the placement group for its trainer actor",
                    hint="lower threads or free resources")
                actor = ray.remote(TrainerActor).options(
                    num_cpus=self.threads, max_restarts=0, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=0),
                ).remote(ray.put(pol), cfg, k, self.threads)
                self._groups.append(_Group(pol.name, None, pg, [actor]))
                continue
            par = a.parallel
            colocate = cfg.rollout.colocate
            engines = cfg.rollout.engines_per_agent if colocate else 0
            bundles = rank_bundles(par, self.threads, engines)
            pg = self.cluster.reserve(
                bundles, timeout_s=timeout_s,
                what=f"agent {pol.name!r}: the placement group for its {par.world} megatron "
                     f"trainer ranks (tp={par.tp} x pp={par.pp} x dp={par.dp}) x "
                     f"{rank_bundles(par, self.threads)[0]}"
                     + (f", {engines} of them with a colocated engine (1 CPU more)"
                        if engines else ""),
                hint="lower threads or tp/pp/dp, or free resources")
            ranks = [remote_cls.options(
                num_cpus=self.threads,
                num_gpus=(COLOCATED_GPU_SHARE if colocate else 1) if par.device == "cuda" else 0,
                max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=r),
            ).remote(pol.name, r, par.world, self.threads, cfg.trainer_setup_hook)
                for r in range(par.world)]
            self._groups.append(_Group(pol.name, par, pg, ranks))
        for g in self._groups:
            for r, a in enumerate(g.ranks):
                what = (f"the trainer actor of agent {g.name!r}" if g.torch else
                        f"megatron trainer rank {r} of agent {g.name!r}")
                self.cluster.wait_started(a.ready.remote(), timeout_s=start_timeout_s, what=what)
        refs = []
        for k, g in enumerate(self._groups):
            if g.torch:
                refs.append([])
                continue
            a = cfg.agents[k]
            addr = self._gather(k, [g.ranks[0].rendezvous.remote(start_timeout_s)],
                                timeout_s=start_timeout_s)[0]
            model = self.policies[k].model
            shards = self._shard_refs(k, model.state_dict())    # each rank gets its own
            par = {**dataclasses.asdict(g.par), "recompute_kw": g.par.recompute_kwargs(),
                   "release_cache": cfg.rollout.colocate, "profile_sync": cfg.profile_sync}
            optim = {"lr": a.optim.lr, "weight_decay": a.optim.weight_decay,
                     "beta1": a.optim.beta1, "beta2": a.optim.beta2,
                     "grad_clip": a.optim.grad_clip}
            dtype = next(model.parameters()).dtype
            refs.append([r.setup.remote(addr, model.config, dtype, shards[i], par, optim,
                                        cfg.seed, start_timeout_s, self.kl)
                         for i, r in enumerate(g.ranks)])
            del shards
        for k, g in enumerate(self._groups):
            g.layout = self._gather(k, refs[k], timeout_s=start_timeout_s)
            for i, lay in enumerate(g.layout):   # shard files are found by this order
                if (lay["tp_rank"], lay["pp_rank"], lay["dp_rank"]) != rank_coords(i, g.par.tp,
                                                                                   g.par.dp):
                    raise RuntimeError(f"agent {g.name!r}: rank {i} is at {lay}, not at "
                                       f"{rank_coords(i, g.par.tp, g.par.dp)} (tp, pp, dp)")
        log.info("megatron trainer groups: %s on %s",
                 ", ".join(f"{g.name} " + ("torch" if g.torch else
                                          f"tp{g.par.tp} pp{g.par.pp} dp{g.par.dp} "
                                          f"({g.layout[0]['built']})")
                           for g in self._groups), self.cluster.address)

    def engine_bundles(self, k: int) -> list[tuple[Any, int]]:
        """``rollout.colocate``: where agent k's vLLM engines run: ``(placement group, bundle
        index)`` of trainer ranks 0 .. engines_per_agent - 1 (engine j shares rank j's GPU; those
        bundles hold its CPU)."""
        g = self._groups[k]
        if g.torch or not self.cfg.rollout.colocate:
            raise ValueError(f"agent {g.name!r}: no colocated engine bundles (rollout.colocate "
                             f"with a megatron group)")
        return [(g.pg, r) for r in range(self.cfg.rollout.engines_per_agent)]

    def rank_actor(self, k: int, r: int):
        """Agent k's rank r actor handle (for inspection and fault-injection tests)."""
        return self._groups[k].ranks[r]

    def _gather(self, k: int, refs: list, timeout_s: float | None = None) -> list:
        """ray.get of one call on agent k's ranks. A dead rank is a clear error naming agent
        and rank (not a hang of the ranks waiting for it in a collective); so is a call not
        answered within ``trainer_call_timeout_s`` (the group is killed)."""
        g = self._groups[k]
        if timeout_s is None:
            timeout_s = getattr(self.cfg, "trainer_call_timeout_s", 0) or None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                for a in g.ranks:
                    ray.kill(a, no_restart=True)
                raise RuntimeError(
                    f"the trainer actor(s) of agent {g.name!r} did not answer a call "
                    f"within {timeout_s:g} s (hung) and were killed; resume the run from its "
                    f"last checkpoint with --resume")
            try:
                ray.get(ready[0])
            except Exception as first:
                raise self._failure(k, refs, first) from first
        return ray.get(refs)

    def _failure(self, k: int, refs: list, first: Exception) -> RuntimeError:
        """The error for a failed call: names the dead rank(s) if any died (the others then
        fail or block in a collective), else the first rank's error."""
        g = self._groups[k]
        ray.wait(refs, num_returns=len(refs), timeout=5.0)
        dead = []
        for r, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                dead.append(r)
            except Exception:
                pass
        if (dead or isinstance(first, RayActorError)) and g.torch:
            return RuntimeError(
                f"the trainer actor of agent {g.name!r} died; its policy and optimizer state "
                f"cannot be recovered mid-step: resume the run from its last checkpoint with "
                f"--resume")
        if dead or isinstance(first, RayActorError):
            which = ", ".join(str(r) for r in dead) or "?"
            return RuntimeError(
                f"megatron trainer rank {which} of agent {g.name!r} died; the group's "
                f"policy shards and optimizer state cannot be recovered mid-step: resume the run "
                f"from its last checkpoint with --resume")
        hint = ""
        if (not g.torch and "CUDA" in str(first) and g.par.device == "cpu"
                and not self.cfg.trainer_setup_hook):
            hint = ("\n(megatron-core makes CUDA calls; running it on CPU needs a "
                    "trainer_setup_hook that maps them to CPU, as the tests' "
                    "tests/launch/_megatron_cpu.py does, or parallel.device=cuda)")
        what = "trainer actor" if g.torch else "megatron trainer rank"
        return RuntimeError(f"a {what} of agent {g.name!r} failed: "
                            f"{type(first).__name__}: {first}{hint}")

    # -- the agent group ------------------------------------------------------------------------
    def old_logprobs(self, pool: StepPool, prompt_ids, micro_batch: int, temperature: float,
                     sw) -> None:
        """As pool.compute_old_logprobs (score_responses: the final EOS is not scored, rows with
        nothing to score get NaN), every generator's ranks at once."""
        lp = torch.full((pool.num_samples,), float("nan"))
        toks: list[torch.Tensor] = [torch.empty(0)] * pool.num_samples
        jobs = []
        for k, g in enumerate(self._groups):
            idx = (pool.agent == k).nonzero().flatten().tolist()
            if g.torch:
                jobs.append((idx, [g.ranks[0].old_logprobs.remote(
                    [prompt_ids[k][int(pool.prompt[i])] for i in idx],
                    [pool.response_ids[i] for i in idx], micro_batch, temperature)]))
                continue
            lens = scored_lengths([pool.response_ids[i] for i in idx],
                                  self.policies[k].tokenizer.eos_id)
            keep = [(i, n) for i, n in zip(idx, lens) if n > 0]
            prompts = [prompt_ids[k][int(pool.prompt[i])] for i, _ in keep]
            resps = [pool.response_ids[i][:n] for i, n in keep]
            jobs.append((keep, [r.old_logprobs.remote(prompts, resps, micro_batch, temperature,
                                                      g.par.micro_batch_tokens)
                                for r in g.ranks]))
        for k, (keep, refs) in enumerate(jobs):
            seconds = 0.0
            if self._groups[k].torch:          # as RayAgents.old_logprobs
                seq, tl, seconds = self._gather(k, refs)[0]
                lp[keep] = seq
                for j, i in enumerate(keep):
                    toks[i] = tl[j]
                key = f"time/old_logprobs/{self.names[k]}"
                sw[key] = sw.get(key, 0.0) + seconds
                continue
            ref_seconds, self._ref_tl[k] = 0.0, {}
            for res in self._gather(k, refs):
                if res is None:
                    continue
                seconds = max(seconds, res["seconds"])
                for row, t in zip(res["rows"], res["toks"]):
                    i = keep[row][0]
                    toks[i] = t
                    lp[i] = t.mean()
                if "ref_toks" in res:
                    ref_seconds = max(ref_seconds, res["ref_seconds"])
                    for row, t in zip(res["rows"], res["ref_toks"]):
                        self._ref_tl[k][keep[row][0]] = t
            key = f"time/old_logprobs/{self.names[k]}"
            sw[key] = sw.get(key, 0.0) + seconds
            if self.kl:
                key = f"time/ref_logprobs/{self.names[k]}"
                sw[key] = sw.get(key, 0.0) + ref_seconds
        pool.lp_old, pool.old_token_logp = lp, toks

    def update(self, k: int, view: LearnerView, pool: StepPool, *, generator: torch.Generator,
               nonfinite: dict, ratio_log: dict | None, sw) -> dict[str, float]:
        """update_learner's M minibatch updates on agent k's ranks (module docstring)."""
        self._updating(k)
        if self._groups[k].torch:
            return self._update_torch(k, view, pool, generator, nonfinite, ratio_log, sw)
        job = self._update_request(k, view, pool, generator,
                                   agent_streak(nonfinite, self.names[k]))
        if job is None:
            return _NO_UPDATE.copy()
        results = self._gather(k, [r.update.remote(job[0]) for r in self._groups[k].ranks])
        return self._update_result(k, view, pool, job[1], results, nonfinite, ratio_log, sw)

    def update_all(self, views: Sequence[LearnerView], pool: StepPool, *,
                   generator: torch.Generator, nonfinite: dict,
                   ratio_logs: Sequence[dict | None], sw, timer) -> list[dict[str, float]]:
        """Every agent's :meth:`update` for two agents or more (agent k on ``views[k]``;
        ``timer(k)`` entered around agent k's), the megatron groups' at once: their requests
        are made in agent order (the minibatch shuffles draw from ``generator`` in that
        order), every group's ranks get theirs before any result is awaited, each group's
        results are awaited by a driver thread of its own (its wall time,
        :func:`~hacpo.engine.rollout.agents_at_once`), and the results are taken in agent
        order (the
        non-finite streak counts across agents as one after another). The same updates as
        one agent after another: a group's ranks stop early on a streak of non-finite updates
        only for their own (a later group is sent its own streak, as the earlier groups'
        results are not in yet; the driver still raises at the same update, the ranks may have run
        more minibatches of a run that then stops). A trainer=torch agent's actor updates at
        the same time, on minibatches the driver drew in its turn, and its updates' trace is
        counted into the streak in its turn (as :meth:`RayAgents.update_all`)."""
        jobs, refs = [], []
        for k, g in enumerate(self._groups):        # requests (and draws) in agent order
            self._updating(k)
            if g.torch:
                jobs.append("torch")
                refs.append([g.ranks[0].update_drawn.remote(
                    views[k], pool.lp_old, pool.old_token_logp,
                    draw_minibatches(self.cfg, views[k], pool, generator),
                    ratio_logs[k] is not None)])
                continue
            name = self.names[k]      # later groups: their own streak (the run's is not known)
            job = self._update_request(k, views[k], pool, generator,
                                       agent_streak(nonfinite, name) if k == 0
                                       else nonfinite.get("agents", {}).get(name, 0))
            jobs.append(job)
            refs.append(None if job is None else [r.update.remote(job[0]) for r in g.ranks])

        def wait(k: int):
            with timer(k):
                return None if refs[k] is None else self._gather(k, refs[k])

        out = []
        futures = agents_at_once(len(views), wait, name="update")
        for k, (job, fut) in enumerate(zip(jobs, futures)):
            results = fut.result()          # an agent's error, in agent order
            if job == "torch":
                out.append(drawn_update_result(results[0], self.names[k], nonfinite,
                                               self.cfg.max_nonfinite, ratio_logs[k], sw))
                continue
            out.append(_NO_UPDATE.copy() if job is None else self._update_result(
                k, views[k], pool, job[1], results, nonfinite, ratio_logs[k], sw))
        return out

    def _update_request(self, k: int, view: LearnerView, pool: StepPool,
                        generator: torch.Generator, streak: int):
        """Agent k's update request for its ranks and its minibatches (drawn from
        ``generator``), or None when it has no samples to train on."""
        cfg, algo = self.cfg, self.cfg.algorithm
        n = view.idx.numel()
        if n == 0:
            return None
        M = algo.num_minibatches * algo.minibatch_factor
        mbs = [mb.tolist() for mb in split_minibatches(
            pool.prompt[view.idx], view.is_self, M, algo.minibatch_order, generator)]
        is_self = view.is_self.tolist()
        ref_tl = {}
        if self.kl:                 # the reference's token log-probs of the self rows
            for j in (j for j in range(n) if is_self[j]):
                i = int(view.idx[j])
                if i not in self._ref_tl[k]:
                    raise RuntimeError(f"agent {self.names[k]!r}: no reference log-probs for "
                                       f"its sample {i} (old_logprobs not run this step?)")
                ref_tl[i] = self._ref_tl[k][i]
        req = {"algo": algo, "view": view, "lp_old": pool.lp_old,
               "kl_coef": algo.loss.kl_coef, "ref_token_logp": ref_tl,
               "old_token_logp": pool.old_token_logp if algo.token_level else [],
               "minibatches": mbs, "micro_batch": cfg.micro_batch,
               "micro_batch_tokens": self._groups[k].par.micro_batch_tokens,
               "temperature": score_temperature(cfg), "streak": streak,
               "max_nonfinite": cfg.max_nonfinite}
        return req, mbs

    def _update_result(self, k: int, view: LearnerView, pool: StepPool, mbs: list,
                       results: list, nonfinite: dict, ratio_log: dict | None, sw
                       ) -> dict[str, float]:
        """Agent k's update metrics from its ranks' ``results``; counts non-finite updates
        (raising past max_nonfinite) and logs the ratios."""
        cfg, algo = self.cfg, self.cfg.algorithm
        n = view.idx.numel()
        is_self = view.is_self.tolist()
        rep = next(r for r in results if r["reporter"] and r["dp_rank"] == 0)
        for stage, v in rep["times"].items():
            key = f"time/{stage}/{self.names[k]}"
            sw[key] = sw.get(key, 0.0) + v
        sums: dict[str, float] = defaultdict(float)
        pooled = UpdateMetrics()
        for m, res in enumerate(rep["minibatches"]):
            new_lp_of, tl_of, kl_of = {}, {}, {}
            for r in results:
                if r["reporter"]:
                    new_lp_of.update(r["minibatches"][m]["new_lp"])
                    tl_of.update(r["minibatches"][m]["tl"])
                    kl_of.update(r["minibatches"][m]["kl"])
            mb_list = mbs[m]
            if ratio_log is not None:
                bound = algo.loss.max_abs_log_ratio     # the log_s the loss used, as
                for part in ("self", "cross"):          # update_learner logs it (SPEC: +-10)
                    js = [j for j in mb_list if is_self[j] == (part == "self")]
                    if js:
                        new = torch.stack([new_lp_of[j] for j in js])
                        ratio_log.setdefault(part, []).append(
                            (new - pool.lp_old[view.idx[js]]).clamp(-bound, bound))
            count_nonfinite(nonfinite, cfg.max_nonfinite, self.names[k], res["finite"],
                            res["loss"], res["grad_norm"])
            if not res["finite"]:
                sums["skipped_updates"] += 1
                continue
            divisor = (sum(len(view.response_ids[j]) for j in mb_list) if algo.token_level
                       else len(mb_list))
            met = _minibatch_metrics(algo, view, mb_list, new_lp_of, tl_of, pool.lp_old,
                                     pool.old_token_logp, m, divisor)
            n_self = sum(is_self[j] for j in mb_list)
            if self.kl and n_self:                  # as update_learner: mean over self rows
                met["kl"] = sum(float(kl_of[j]) for j in mb_list if is_self[j]) / n_self
            # pooled over the applied updates as update_learner does (update.UpdateMetrics)
            pooled.add({"loss": res["loss"], "grad_norm": res["grad_norm"],
                        **{key: float(v) for key, v in met.items()}},
                       n_self=n_self, n_cross=len(mb_list) - n_self,
                       n_tokens=sum(len(view.response_ids[j]) for j in mb_list))
        sums.update(pooled.result())
        sums["trained_samples"] = float(n)
        sums["trained_self"] = float(view.is_self.sum())
        sums["trained_cross"] = float((~view.is_self).sum())
        # what the DP replicas' forwards ran on (one reporting rank each), all minibatches
        sums["tokens_update_padded"] = float(sum(r["padded_tokens"] for r in results
                                                 if r["reporter"]))
        sums["update_micro_batches"] = float(sum(r["micro_batches"] for r in results
                                                 if r["reporter"]))
        return dict(sums)

    def _update_torch(self, k, view, pool, generator, nonfinite, ratio_log, sw):
        """A trainer=torch agent: RayAgents.update's call of its TrainerActor."""
        return actor_update(lambda ref: self._gather(k, [ref])[0], self._groups[k].ranks[0],
                            view, pool, generator=generator, nonfinite=nonfinite,
                            ratio_log=ratio_log, sw=sw)

    def _buckets(self, k: int, mb: float | None = None) -> list[list[tuple[str, int]]]:
        """Agent k's weight units (embedding, each layer, final norm + output layer) grouped
        into buckets of at most ``mb`` (default ``parallel.weight_bucket_mb``) by the HF
        copy's tensor sizes (a larger unit is a bucket of its own): what one weight-stream
        call moves."""
        from hacpo.models.megatron import hf_units, unit_of_hf_name
        from hacpo.models.megatron.build import ArchSpec

        model, par = self.policies[k].model, self._groups[k].par
        size: dict[tuple[str, int], int] = defaultdict(int)
        for name, t in self._hf_targets(k).items():
            size[unit_of_hf_name(name)] += t.numel() * t.element_size()
        units = hf_units(ArchSpec.from_hf(model.config))
        return plan_buckets([(u, size[u]) for u in units],
                            bucket_bytes_of(par.weight_bucket_mb if mb is None else mb))

    def _hf_targets(self, k: int) -> dict[str, torch.Tensor]:
        """The driver's HF tensors a megatron pull writes (sharing the parameters' storage;
        a tied model's ``lm_head.weight`` is the embedding and is not sent)."""
        model = self.policies[k].model
        sd = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd

    def _stream_weights(self, k: int):
        """Agent k's HF-named weights bucket by bucket (each bucket one collective call of the
        group: rank 0 holds at most its shard plus one bucket, the driver one bucket)."""
        g = self._groups[k]
        buckets = self._buckets(k)
        self.weight_buckets[k] = len(buckets)
        for units in buckets:
            yield self._gather(k, [r.hf_weights.remote(units) for r in g.ranks])[0]

    def publish_weights(self, k: int) -> list | None:
        """Agent k's trained weights as HF-named buckets in the object store, put by its rank
        0 (each bucket a collective call of the group, as :meth:`pull_weights` streams them),
        never passing through the driver: ObjectRefs in bucket order, in the driver policy's
        own shapes (a tied output layer in none; names and shapes checked against it first),
        what a rollout engine that loads refs reads (``VLLMRolloutEngine.sync_published``).
        A bucket holds at most the smaller of ``parallel.weight_bucket_mb`` and
        ``rollout.weight_bucket_mb`` (or one unit), as an engine holds one at a time. The
        driver's policy is refreshed from the same buckets only when something reads it
        (:meth:`pull_weights`). None for a trainer=torch agent (its weights come through
        :meth:`pull_weights`)."""
        g = self._groups[k]
        if g.torch:
            return None
        buckets = self._buckets(k, min(g.par.weight_bucket_mb, self.cfg.rollout.weight_bucket_mb))
        self.weight_buckets[k] = len(buckets)
        got = [self._gather(k, [r.hf_weights_put.remote(units) for r in g.ranks])[0]
               for units in buckets]
        check_bucket_shapes(self._hf_targets(k), (shapes for _, shapes in got),
                            what=f"agent {self.names[k]!r}: megatron weights for the engines")
        self._published[k] = [ref for ref, _ in got]
        return self._published[k]

    def _fetch_published(self, k: int):
        """The buckets :meth:`publish_weights` put, one at a time; objects gone with the rank
        that owned them are a clear error."""
        from ray.exceptions import ObjectLostError

        for ref in self._published[k]:
            try:
                yield ray.get(ref)
            except ObjectLostError as e:
                raise RuntimeError(
                    f"the weights agent {self.names[k]!r}'s megatron rank 0 published are "
                    f"lost ({type(e).__name__}: the rank died?); resume the run from its last "
                    f"checkpoint with --resume") from e

    def _updating(self, k: int) -> None:
        """Agent k's ranks are about to update: the driver's policy is behind them until
        pulled, and no buckets are published for the new weights yet."""
        self._stale[k], self._published[k] = True, None

    def pull_weights(self, k: int) -> None:
        """Bring the driver's policy up to agent k's trained shards (what evaluation,
        checkpoints and the rollout engines that sample with it read): nothing if no update
        since the last pull; else the buckets :meth:`publish_weights` put, if it ran since,
        or the shards streamed as HF weights ``parallel.weight_bucket_mb`` at a time, copied
        in place. A failure part-way (a dead rank) is an error that stops the run: the policy
        is then partly updated, but no checkpoint is written from it (the last one stays
        whole)."""
        if self._groups[k].torch:
            self.policies[k].load_state_dict(
                self._gather(k, [self._groups[k].ranks[0].weights.remote()])[0])
            return
        if not self._stale[k]:
            return
        copy_buckets(self._hf_targets(k),
                     self._stream_weights(k) if self._published[k] is None
                     else self._fetch_published(k),
                     what=f"agent {self.names[k]!r}: megatron weights into the HF model")
        self._stale[k] = False

    def _shard_refs(self, k: int, hf: dict[str, torch.Tensor]) -> list:
        """Agent k's HF-named tensors cut into its ranks' shards (megatron names,
        ``hf_to_megatron``): one object-store ref per rank (see :func:`shard_refs`)."""
        from hacpo.models.megatron import hf_to_megatron

        arch, par = self._arch(k), self._groups[k].par
        return shard_refs(lambda tp_rank, pp_rank: hf_to_megatron(
            hf, arch, tp=par.tp, tp_rank=tp_rank, pp=par.pp, pp_rank=pp_rank,
            transformer_impl=par.transformer_impl), par.tp, par.pp, par.dp)

    def _layout(self, k: int) -> dict:
        par = self._groups[k].par
        return {"tp": par.tp, "pp": par.pp, "dp": par.dp,
                "transformer_impl": par.transformer_impl,
                "make_vocab_size_divisible_by": par.make_vocab_size_divisible_by,
                "distributed_optimizer": par.distributed_optimizer}

    def _arch(self, k: int):
        """Agent k's ArchSpec (its vocabulary padding)."""
        from hacpo.models.megatron.build import ArchSpec

        return ArchSpec.from_hf(self.policies[k].model.config, make_vocab_size_divisible_by=self
                                ._groups[k].par.make_vocab_size_divisible_by)

    def shard_root(self, k: int) -> str:
        """Where agent k's ranks write their optimizer shards (one directory per save)."""
        return os.path.join(self.out_dir, "checkpoint-megatron", self.names[k])

    def state_dict(self, k: int) -> dict[str, Any]:
        """Full HF-named weights (as the torch trainer's ``model``), the layout, and the files
        the ranks wrote their optimizer states to (paths relative to out_dir; see the module
        docstring)."""
        g = self._groups[k]
        if g.torch:
            return self._gather(k, [g.ranks[0].state_dict.remote()])[0]
        self.pull_weights(k)
        d = os.path.join(self.shard_root(k), uuid.uuid4().hex[:12])
        written = self._gather(k, [r.save_optim.remote(os.path.join(d, f"rank-{i}.pt"))
                                   for i, r in enumerate(g.ranks)])
        self._shard_dirs[k] = d
        check_shards_visible(written, f"agent {self.names[k]!r}")
        meg = {**self._layout(k), "optim_files": [os.path.relpath(w["path"], self.out_dir)
                                                  for w in written],
               "optim_bytes": [w["bytes"] for w in written]}
        if self.kl:                          # the KL reference's shards, written once
            if self._ref_files[k] is None:
                ref_dir = os.path.join(self.shard_root(k), f"reference-{uuid.uuid4().hex[:12]}")
                refs = self._gather(k, [r.save_reference.remote(
                    os.path.join(ref_dir, f"rank-{i}.pt")) for i, r in enumerate(g.ranks)])
                check_shards_visible(refs, f"agent {self.names[k]!r} (KL reference)")
                self._ref_files[k] = [{"path": os.path.relpath(w["path"], self.out_dir),
                                       "bytes": w["bytes"]} for w in refs]
            meg["ref_files"] = self._ref_files[k]
        return {"model": self.policies[k].state_dict(), "megatron": meg}

    def load_state_dict(self, k: int, sd: dict[str, Any]) -> None:
        if self._groups[k].torch:
            self._gather(k, [self._groups[k].ranks[0].load_state_dict.remote(sd)])
            self.policies[k].load_state_dict(sd["model"])
            return
        meg = sd.get("megatron")
        name, want = self.names[k], self._layout(k)
        if meg is None:
            raise ValueError(f"agent {name!r}: the checkpoint holds no megatron trainer state "
                             f"(written with trainer=torch?); it cannot resume trainer=megatron")
        # a checkpoint from before vocabulary padding / the distributed optimizer existed: its
        # layout had neither
        old = {"make_vocab_size_divisible_by": 1, "distributed_optimizer": False}
        have = {key: meg.get(key, old.get(key)) for key in want}
        # another tp / pp / dp / optimizer kind: the state moves (by parameter name, through
        # HF names, as the weights); anything else is an error
        moved = have != want
        if moved and {key for key in want if have[key] != want[key]} - set(MOVABLE_LAYOUT):
            raise ValueError(f"agent {name!r}: the checkpoint's megatron layout {have} differs "
                             f"from this run's {want}; optimizer state moves to another "
                             f"{' / '.join(MOVABLE_LAYOUT)} only: resume with the checkpoint's "
                             f"layout")
        ref = meg.get("ref_hf")          # a checkpoint from before: HF-named weights
        g = self._groups[k]
        written_by = have["tp"] * have["pp"] * have["dp"]     # ranks that wrote the shards
        if self.kl and "ref_files" in meg:  # the ranks' own shards (written once per run)
            ref = check_named_shards(meg["ref_files"], self.out_dir, written_by, name,
                                     "KL reference")
            self._ref_files[k] = list(meg["ref_files"])
            if moved:                       # gathered to HF names; this layout's shards are
                ref = weights_of_shards(ref, have, self._arch(k))   # written at the next save
                self._ref_files[k] = None
        if self.kl and ref is None:
            raise ValueError(f"agent {name!r}: the checkpoint holds no KL reference weights "
                             f"(written with algorithm.loss.kl_coef=0?); it cannot resume a run "
                             f"with the KL term")
        if "optim_files" in meg:            # written by the ranks (module docstring)
            sizes = meg.get("optim_bytes") or [None] * len(meg["optim_files"])  # older: none
            optim = check_named_shards(
                [{"path": f, "bytes": b} for f, b in zip(meg["optim_files"], sizes)],
                self.out_dir, written_by, name, "optimizer")
            self._shard_dirs[k] = os.path.dirname(optim[0])
            if moved:
                from hacpo.models.megatron.convert import moments_from_hf

                step, hf_moments, scalers = moments_of_shards(optim, have, self._arch(k), name)
                arch, par = self._arch(k), g.par
                optim = shard_refs(lambda tp_rank, pp_rank: {
                    "moved": moments_from_hf(step, hf_moments, arch, tp=par.tp,
                                             tp_rank=tp_rank, pp=par.pp, pp_rank=pp_rank,
                                             transformer_impl=par.transformer_impl)
                    if hf_moments else {}, "grad_scalers": scalers}, par.tp, par.pp, par.dp)
                del hf_moments
        elif moved:
            raise ValueError(f"agent {name!r}: the checkpoint's optimizer state (inside the "
                             f"file, an older format) cannot move to another layout: resume "
                             f"with the checkpoint's {have}")
        else:                               # a checkpoint from before: states in the file
            optim = meg["optim"]
        self.policies[k].load_state_dict(sd["model"])
        weights = self._shard_refs(k, self.policies[k].model.state_dict())
        if isinstance(ref, list):
            refs = ref                                         # a shard file per rank
        else:                                                  # HF-named: cut per rank
            refs = self._shard_refs(k, ref) if self.kl else [None] * len(g.ranks)
        self._gather(k, [r.load.remote(weights[i], optim[i], refs[i])
                         for i, r in enumerate(g.ranks)])
        # the driver's policy and the ranks now hold the checkpoint's weights
        self._stale[k], self._published[k] = False, None
        # shard directories the checkpoint does not name: a crash between a save's checkpoint
        # rename and its checkpoint_saved() left the previous save's (a resume that trains no
        # further step never saves again to drop them), or a crash mid-save left its own
        named = [os.path.join(self.out_dir, f) for f in meg.get("optim_files", [])]
        named += [os.path.join(self.out_dir, f["path"]) for f in meg.get("ref_files") or []]
        self._prune_shard_dirs(k, {os.path.dirname(f) for f in named})

    def checkpoint_saved(self) -> None:
        """The trainer wrote a checkpoint naming the shards of the last :meth:`state_dict`
        calls: delete every other shard directory of those agents (older saves, and saves a
        crash left unnamed)."""
        for k, d in enumerate(self._shard_dirs):
            if d is None:
                continue
            keep = {d}
            if self._ref_files[k]:                 # the KL reference's shards (written once)
                keep.add(os.path.dirname(os.path.join(self.out_dir,
                                                      self._ref_files[k][0]["path"])))
            self._prune_shard_dirs(k, keep)

    def _prune_shard_dirs(self, k: int, keep: set[str]) -> None:
        """Delete agent k's shard directories other than ``keep`` (absolute paths)."""
        keep = {os.path.normpath(d) for d in keep}
        root = self.shard_root(k)
        for other in os.listdir(root) if os.path.isdir(root) else ():
            path = os.path.join(root, other)
            if os.path.normpath(path) not in keep and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)

    def evaluate(self, prompt_ids: list[list[list[int]]], golds: list[str], rc,
                 **kwargs) -> list[dict]:
        """evaluate_policy on the driver's HF copies (the ranks' weights, pulled first)."""
        for k in range(len(self.policies)):
            self.pull_weights(k)
        return [evaluate_policy(p, prompt_ids[k], golds, rc, **kwargs)
                for k, p in enumerate(self.policies)]

    def close(self) -> None:
        """Kill the rank actors, remove the placement groups, stop/leave the cluster.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        RayCluster.release([a for g in self._groups for a in g.ranks],
                           [g.pg for g in self._groups])
        self._groups = []
        if self.cluster is not None:
            self.cluster.shutdown()
