"""A megatron-core TP/PP/DP policy: per-token log-probs and one optimizer step.

    par = init_parallel(tp=2, pp=1)
    pol = MegatronPolicy.from_hf(hf_model, par)            # builds GPTModel, loads this shard
    lp = pol.token_logprobs(input_ids, targets)            # [B, S] float32 on every rank
    lp = pol.token_logprobs(input_ids, targets, positions=pos, mask=m)   # [B, T]: only those
    opt = pol.build_optimizer(lr=1e-5)                     # megatron DDP + megatron optimizer
    metrics = pol.train_step(opt, microbatches, loss_fn)   # loss_fn(lp, mb) -> (loss, metrics)
    pol.last_step        # {"step_skipped", "loss_scale", "grad_norm"}: fp16's dynamic loss
                         # scaler skips overflowing steps (as megatron), see train_step

Only the positions asked for are scored (``positions`` [B, T] into the sequence, ``mask``
[B, T]; the trainer asks for the response tokens): prompt, padding and pad-row positions never
reach the output layer. Two ways to turn the last stage's hidden states into log-probs
(``lm_head``):

- ``"fused"`` (default): the model returns its final hidden states (megatron's output layer is
  skipped) and ``hacpo.kernels.fused_linear_token_logprobs(hidden, weight, targets, tp_group=...)``
  computes the log-probs of the selected positions from the output layer's weight shard
  [Vp/tp, H] in row chunks: the logits [n, Vp/tp] never exist whole, in the forward or the
  backward (which recomputes each chunk), and the gradient reaches the weight and the hidden
  states as megatron's output layer would send it (the hidden-state gradient all-reduced over
  TP).
- ``"logits"``: megatron's own output layer makes the vocab-parallel logits [b, S, Vp/tp] of
  every position; the selected rows go through ``hacpo.kernels.token_logprobs(logits, targets,
  tp_group=...)``. Costs the whole logits and their gradient; kept as the reference and for
  comparison (``benchmarks/bench_megatron_lm_head.py``).

Either way full logits are never gathered over TP, and a vocabulary padded for TP (Vp > V, see
:mod:`hacpo.models.megatron.build`) has its padded columns at -inf: the log-probs are those of
the real V-way softmax. Micro-batches run through megatron-core's own schedule
(``get_forward_backward_func``: no pipelining at PP=1, 1F1B at PP>1); they may differ in shape
(at PP > 1 the stages exchange activation shapes, ``variable_seq_lengths``), so each is padded
only to its own longest row, and :meth:`token_logprobs` cuts each micro-batch after its last
scored position (a causal model: later tokens do not change earlier log-probs); with
``micro_batch_tokens`` it packs the rows by a token budget (:mod:`hacpo.engine.batching`).

Loss convention (pass the divisor in): ``loss_fn`` returns a loss already divided by the *global*
divisor (e.g. the number of samples of the whole minibatch across micro-batches and DP ranks);
gradients are therefore *summed* over micro-batches and DP ranks (megatron's
``calculate_per_token_loss`` mode, no 1/num_microbatches or 1/dp scaling), so a step does not
depend on how the batch is split.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hacpo.kernels import fused_linear_token_logprobs, token_logprobs
from hacpo.models.megatron.build import ArchSpec, Parallel, build_gpt_model, require_megatron
from hacpo.models.megatron.convert import (Unit, hf_to_megatron, hf_units, load_megatron_state,
                                           megatron_to_hf, unit_megatron_names, unit_stage,
                                           unit_to_hf)
from hacpo.models.policy import LM_HEADS   # "logits" | "fused": see the module docstring

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]
# what train_step adds to each micro-batch's metrics (a loss_fn may not use these names)
STEP_KEYS = frozenset({"step_skipped", "loss_scale"})


class MegatronPolicy:
    """One rank's shard of a megatron GPTModel plus the parallel layout it lives in.

    Args:
        model: this rank's ``GPTModel`` (or its megatron DDP wrapper after
            :meth:`build_optimizer`).
        arch: the architecture (for weight mapping).
        par: this rank's :class:`~hacpo.models.megatron.build.Parallel`.
        transformer_impl: "local" or "transformer_engine" (weight names differ).
        logprob_backend: ``hacpo.kernels`` backend ("auto": Triton on CUDA, torch elsewhere;
            "triton" is an error where Triton cannot run, never a fallback).
        lm_head: "fused" or "logits" (the module docstring).
    """

    def __init__(self, model: torch.nn.Module, arch: ArchSpec, par: Parallel,
                 transformer_impl: str = "local", *, logprob_backend: str = "auto",
                 lm_head: str = "fused"):
        if lm_head not in LM_HEADS:
            raise ValueError(f"lm_head must be one of {', '.join(LM_HEADS)}, got {lm_head!r}")
        self.model, self.arch, self.par = model, arch, par
        self.transformer_impl = transformer_impl
        self.logprob_backend = logprob_backend
        self.lm_head = lm_head
        # the last train_step's {"step_skipped", "loss_scale", "grad_norm"} (on every rank)
        self.last_step: dict | None = None

    @classmethod
    def from_hf(cls, hf_model, par: Parallel, *, transformer_impl: str = "local",
                params_dtype=torch.float32, logprob_backend: str = "auto",
                make_vocab_size_divisible_by: int = 1,
                lm_head: str = "fused", sequence_parallel: bool = False,
                recompute: dict | None = None) -> "MegatronPolicy":
        """Build this rank's GPTModel from an HF model's config and load its weights shard
        (``make_vocab_size_divisible_by``: the vocabulary padding, see ``ArchSpec``;
        ``sequence_parallel``: megatron's, see :mod:`hacpo.models.megatron.build`;
        ``recompute``: activation recomputation, see
        :func:`~hacpo.models.megatron.build.recompute_fields`)."""
        arch = ArchSpec.from_hf(hf_model.config,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        state = hf_to_megatron(hf_model.state_dict(), arch, tp=par.tp, tp_rank=par.tp_rank,
                               pp=par.pp, pp_rank=par.pp_rank, transformer_impl=transformer_impl)
        return cls.from_state(hf_model.config, state, par, transformer_impl=transformer_impl,
                              params_dtype=params_dtype, logprob_backend=logprob_backend,
                              make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                              lm_head=lm_head, sequence_parallel=sequence_parallel,
                              recompute=recompute)

    @classmethod
    def from_state(cls, hf_config, state: dict[str, torch.Tensor], par: Parallel, *,
                   transformer_impl: str = "local", params_dtype=torch.float32,
                   logprob_backend: str = "auto", make_vocab_size_divisible_by: int = 1,
                   lm_head: str = "fused", sequence_parallel: bool = False,
                   recompute: dict | None = None) -> "MegatronPolicy":
        """:meth:`from_hf` from an HF config and this rank's shard of the weights already in
        megatron names (``hf_to_megatron`` for this rank's tp_rank / pp_rank, e.g. cut by the
        trainer's driver): the rank never holds the whole model. Arguments as
        :meth:`from_hf`."""
        arch = ArchSpec.from_hf(hf_config,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        model = build_gpt_model(arch, par, transformer_impl=transformer_impl,
                                params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                recompute=recompute)
        load_megatron_state(model, state)
        return cls(model, arch, par, transformer_impl, logprob_backend=logprob_backend,
                   lm_head=lm_head)

    # -- weights --------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (unwrapped from megatron DDP)."""
        return getattr(self.model, "module", self.model)

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights by megatron name (detached; megatron's ``_extra_state`` entries,
        e.g. transformer-engine's empty CPU tensors, are no weights and are left out: a TP
        all-gather of them over NCCL would fail)."""
        return {k: v.detach() for k, v in self.module.state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}

    def hf_state_dict(self, *, everywhere: bool = True) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights (a collective of every rank).

        ``everywhere=True``: on every rank (the TP shards all-gathered, then the PP stages with
        an object all-gather; each rank then holds a full copy).
        ``everywhere=False``: only on global rank 0 (TP 0, PP 0, DP 0), None elsewhere:
        :meth:`hf_state_of_units` of every unit, so no other rank ever holds more than its
        shard. To bound rank 0's memory too, call :meth:`hf_state_of_units` a few units at a
        time (``hacpo/launch/megatron_trainer.py`` does, in buckets). Returned tensors may
        share storage with this rank's parameters (replicated norms; at TP=1 the rest too):
        clone what must outlive an optimizer step."""
        if not everywhere:
            return self.hf_state_of_units(hf_units(self.arch))
        local, p = self.local_state(), self.par
        if p.tp > 1:
            tp_shards: list[dict] = [dict() for _ in range(p.tp)]
            for name, t in local.items():
                parts = [torch.empty_like(t) for _ in range(p.tp)]
                dist.all_gather(parts, t.contiguous(), group=p.tp_group)
                for r in range(p.tp):
                    tp_shards[r][name] = parts[r]
        else:
            tp_shards = [local]
        if p.pp > 1:
            stages: list[Any] = [None] * p.pp
            dist.all_gather_object(stages, tp_shards, group=p.pp_group)
        else:
            stages = [tp_shards]
        return megatron_to_hf(stages, self.arch, transformer_impl=self.transformer_impl)

    def hf_state_of_units(self, units: Sequence[Unit]) -> dict[str, torch.Tensor] | None:
        """The HF-named weights of ``units`` (see :func:`~hacpo.models.megatron.convert.
        hf_units`) on global rank 0, None elsewhere; a collective of every rank, each called
        with the same units.

        DP replicas other than 0 send nothing (their weights are replica 0's). In replica 0,
        unit by unit: the unit's tensors are gathered to TP rank 0 of the stage that holds it
        (tensor gathers); a stage other than the first then sends them to PP rank 0 point to
        point (names, shapes and dtypes went ahead in one small object gather), which
        converts each unit as soon as it has it. So besides its shard a rank holds one
        unit's TP parts at a time, and global rank 0 also the converted units it returns."""
        p, arch = self.par, self.arch
        units = [tuple(u) for u in units]
        stages = [unit_stage(u, arch, p.pp) for u in units]     # an unknown unit: error here
        if p.dp_rank != 0:
            return None
        local = self.local_state()
        names = {u: unit_megatron_names(u, local, arch, p.pp)
                 for u, st in zip(units, stages) if st == p.pp_rank}
        first = dist.get_global_rank(p.pp_group, 0) if p.pp > 1 else None
        metas = None
        if p.pp > 1 and p.tp_rank == 0:      # what the other stages will send to PP rank 0
            meta = ({u: [(n, tuple(local[n].shape), local[n].dtype) for n in ns]
                     for u, ns in names.items()} if p.pp_rank != 0 else {})
            metas = [None] * p.pp if p.pp_rank == 0 else None
            dist.gather_object(meta, metas, dst=first, group=p.pp_group)
        device = next(iter(local.values())).device
        converted: dict[Unit, list[tuple[str, torch.Tensor]]] = {}
        for unit, stage in zip(units, stages):
            if stage == p.pp_rank:
                parts = self._tp_parts(names[unit], local)      # on TP rank 0, else None
                if parts is None:
                    continue
                if p.pp_rank == 0:
                    converted[unit] = list(unit_to_hf(unit, parts, arch, pp=p.pp,
                                                      transformer_impl=self.transformer_impl))
                else:
                    for part in parts:
                        for t in part.values():
                            dist.send(t.contiguous(), dst=first, group=p.pp_group)
            elif p.pp_rank == 0 and p.tp_rank == 0:
                src = dist.get_global_rank(p.pp_group, stage)
                parts = []
                for _ in range(p.tp):
                    part = {}
                    for n, shape, dtype in metas[stage][unit]:
                        part[n] = torch.empty(shape, dtype=dtype, device=device)
                        dist.recv(part[n], src=src, group=p.pp_group)
                    parts.append(part)
                converted[unit] = list(unit_to_hf(unit, parts, arch, pp=p.pp,
                                                  transformer_impl=self.transformer_impl))
        if p.tp_rank != 0 or p.pp_rank != 0:
            return None
        return {n: t for u in units for n, t in converted[u]}

    def _tp_parts(self, names: list[str], local: dict[str, torch.Tensor]
                  ) -> list[dict[str, torch.Tensor]] | None:
        """``names``' tensors of every TP rank of this stage (tensor gathers to TP rank 0):
        ``parts[tp_rank]`` on TP rank 0, None elsewhere."""
        p = self.par
        if p.tp == 1:
            return [{n: local[n] for n in names}]
        parts: list[dict[str, torch.Tensor]] = [dict() for _ in range(p.tp)]
        dst = dist.get_global_rank(p.tp_group, 0)
        for n in names:
            t = local[n].contiguous()
            got = [torch.empty_like(t) for _ in range(p.tp)] if p.tp_rank == 0 else None
            dist.gather(t, got, dst=dst, group=p.tp_group)
            for r in range(p.tp) if got is not None else ():
                parts[r][n] = got[r]
        return parts if p.tp_rank == 0 else None

    # -- forward --------------------------------------------------------------------------------
    @property
    def sequence_parallel(self) -> bool:
        return bool(self.module.config.sequence_parallel)

    def padded_length(self, n: int) -> int:
        """The positions a row of ``n`` tokens occupies in :meth:`forward`: ``n``, or with
        sequence parallelism ``n`` rounded up to a multiple of tp."""
        m = self.par.tp if self.sequence_parallel else 1
        return -(-n // m) * m

    def logprobs_from_logits(self, logits: torch.Tensor, targets: torch.Tensor,
                             temperature: float = 1.0) -> torch.Tensor:
        """This rank's vocab-parallel logits [..., Vp/tp] (rows of the last stage's model output)
        and global target ids [...] -> log p(targets) [...] float32 under the real V-way
        softmax.

        Padded vocabulary columns (ids >= V, only on the last TP rank(s)) are set to -inf *in
        place* (the logits are a fresh tensor: the model's output or rows selected from it; a
        masked copy would double the shard's memory): they get probability 0 and zero
        gradient, so the padded output-layer rows keep a zero gradient."""
        shard = self.arch.padded_vocab_size(self.par.tp) // self.par.tp
        if logits.shape[-1] != shard or logits.shape[:-1] != targets.shape:
            raise ValueError(f"logits {tuple(logits.shape)} do not match targets "
                             f"{tuple(targets.shape)} and this rank's shard of the padded "
                             f"vocabulary ({shard} columns)")
        n_real = self.arch.real_vocab_of_rank(self.par.tp, self.par.tp_rank)
        if n_real < logits.shape[-1]:
            logits[..., n_real:] = float("-inf")
        return token_logprobs(logits.reshape(-1, shard), targets.reshape(-1),
                              temperature=temperature, tp_group=self.par.tp_group,
                              backend=self.logprob_backend, validate=False).view(targets.shape)

    def output_weight(self) -> torch.Tensor:
        """The last stage's output-layer weight shard [Vp/tp, H] (a tied model's: the word
        embedding at PP=1, megatron's synchronised copy on the last stage at PP>1)."""
        m = self.module
        if not self.par.last_stage:
            raise RuntimeError("only the last pipeline stage holds the output layer")
        if self.arch.tie_word_embeddings and m.pre_process:
            return m.embedding.word_embeddings.weight
        return m.output_layer.weight

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor):
        """Run ``model`` (this policy's model, or megatron's schedule's handle on it) on
        ``input_ids`` [b, S]. The last stage returns what :meth:`logprobs_at` takes: final
        hidden states [S', b, H] with ``lm_head="fused"`` (megatron's output layer skipped),
        vocab-parallel logits [b, S', Vp/tp] with ``"logits"``; other stages their activations.
        S' = S, or with sequence parallelism S rounded up to a multiple of tp: the rows are
        padded with token 0 at the end, which a causal model's first S positions never see
        (the last stage's hidden states are gathered back to the whole sequence here, as
        megatron's output layer would)."""
        b, s = input_ids.shape
        if self.padded_length(s) > s:
            pad = self.padded_length(s) - s
            input_ids = torch.cat([input_ids, input_ids.new_zeros(b, pad)], dim=1)
            s += pad
        pos = torch.arange(s, device=input_ids.device).expand(b, s)
        if self.lm_head == "logits" or not self.par.last_stage:
            return model(input_ids, pos, attention_mask=None)
        module = self.module
        module.post_process = False     # GPTModel returns the decoder's output (final norm
        try:                            # applied) before its output layer
            hidden = model(input_ids, pos, attention_mask=None)
        finally:
            module.post_process = True
        if self.sequence_parallel:      # [S'/tp, b, H] -> [S', b, H]; the fused head's hidden
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # gradient arrives already summed over TP (the fused head all-reduces it), so the
            # backward only takes this rank's slice
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.par.tp_group)
        return hidden

    def logprobs_at(self, output: torch.Tensor, targets: torch.Tensor,
                    positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                    temperature: float = 1.0) -> torch.Tensor:
        """The last stage's :meth:`forward` output, global targets [b, S] (``targets[i, j]`` is
        the token predicted at position j) -> log-probs [b, T] float32 of
        ``targets[i, positions[i, k]]`` where ``mask[i, k]``, 0 elsewhere (no position is
        scored that the mask leaves out); differentiable. ``positions=None``: every position
        (T = S). The output may cover more positions than S (sequence parallelism's padding,
        see :meth:`forward`): only the first S are read."""
        b, s = targets.shape
        dev = targets.device
        if (positions is None) != (mask is None):
            raise ValueError("pass positions and mask together")
        if positions is None:
            positions = torch.arange(s).expand(b, s)
            mask = torch.ones(b, s, dtype=torch.bool)
        if positions.shape != mask.shape or positions.shape[0] != b:
            raise ValueError(f"positions {tuple(positions.shape)} and mask "
                             f"{tuple(mask.shape)} must both be [{b}, T]")
        # the selection is computed where positions live (the trainer's are on the host: no
        # device sync), then moved
        rows, cols = mask.nonzero(as_tuple=True)
        at = positions[rows, cols]
        if at.numel() and not 0 <= int(at.min()) <= int(at.max()) < s:
            raise ValueError(f"positions must lie in [0, {s}), got {int(at.min())}.."
                             f"{int(at.max())}")
        rows, cols, at = rows.to(dev), cols.to(dev), at.to(dev)
        tgt = targets[rows, at]
        s_out = output.shape[0] if self.lm_head == "fused" else output.shape[1]
        if s_out != self.padded_length(s):
            raise ValueError(f"the model output {tuple(output.shape)} does not cover the "
                             f"{s} positions of targets {tuple(targets.shape)}")
        if self.lm_head == "fused":
            if output.shape[1] != b:
                raise ValueError(f"hidden states {tuple(output.shape)} are not [{s}, {b}, H]")
            lp = fused_linear_token_logprobs(
                output[at, rows], self.output_weight(), tgt, temperature=temperature,
                backend=self.logprob_backend, tp_group=self.par.tp_group, validate=False,
                vocab_size=self.arch.vocab_size)
        else:
            lp = self.logprobs_from_logits(output[rows, at], tgt, temperature)
        return lp.new_zeros(tuple(mask.shape)).index_put((rows, cols), lp)

    def _forward_step(self, temperature: float, loss_fn: LossFn | None,
                      losses: list | None, data_iterator, model):
        mb = next(data_iterator)
        out = self.forward(model, mb["input_ids"])

        def loss_func(output):
            lp = self.logprobs_at(output, mb["targets"], mb.get("positions"),
                                  mb.get("positions_mask"), temperature)
            if loss_fn is None:
                return lp.sum() * 0.0, torch.ones((), dtype=torch.int), {"logprobs": lp.detach()}
            loss, metrics = loss_fn(lp, mb)
            reserved = STEP_KEYS & set(metrics)
            if reserved:
                raise ValueError(f"loss_fn's metrics use {sorted(reserved)}: train_step "
                                 f"reports the step under those keys; rename them")
            if losses is not None:
                losses.append(loss.detach())
            return loss, torch.ones((), dtype=torch.int), {"logprobs": lp.detach(), **metrics}

        return out, loss_func

    def _run(self, microbatches: Sequence[dict], *, forward_only: bool, temperature: float,
             loss_fn: LossFn | None, losses: list | None = None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shapes = [tuple(mb["input_ids"].shape) for mb in microbatches]
        if self.par.pp > 1 and not self.module.config.variable_seq_lengths and \
                len(set(shapes)) > 1:
            raise ValueError(f"micro-batches of different shapes {sorted(set(shapes))} need "
                             f"the model config's variable_seq_lengths at PP > 1")
        fb = get_forward_backward_func()
        return fb(forward_step_func=partial(self._forward_step, temperature, loss_fn, losses),
                  data_iterator=iter(microbatches), model=[self.model],
                  num_microbatches=len(microbatches), seq_length=max(s for _, s in shapes),
                  micro_batch_size=max(b for b, _ in shapes), forward_only=forward_only)

    def _from_last_stage(self, t: torch.Tensor | None, shape) -> torch.Tensor:
        """Broadcast a tensor that exists on the last PP stage to every stage (the other
        stages' buffer on the parameters' device: NCCL broadcasts CUDA tensors only)."""
        if self.par.pp == 1:
            return t
        if t is not None:
            buf = t.contiguous()
        else:
            device = next(self.module.parameters()).device
            buf = torch.empty(shape, dtype=torch.float32, device=device)
        src = dist.get_global_rank(self.par.pp_group, self.par.pp - 1)
        dist.broadcast(buf, src=src, group=self.par.pp_group)
        return buf

    @torch.no_grad()
    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, *,
                       positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       temperature: float = 1.0, micro_batch_size: int | None = None,
                       micro_batch_tokens: int | None = None):
        """input_ids [B, S], targets [B, S] (global token ids; usually ids shifted by one) ->
        log p(targets) [B, S] float32 on every rank (computed on the last PP stage); with
        ``positions`` / ``mask`` [B, T] only those positions: [B, T] (see :meth:`logprobs_at`),
        each micro-batch cut after its last scored position. One pipelined schedule over
        micro-batches of ``micro_batch_size`` rows in order (the last one may be smaller), or
        with ``micro_batch_tokens`` rows packed longest first (a row's length: up to its last
        scored position) into micro-batches of at most that many padded tokens and
        ``micro_batch_size`` rows (:func:`hacpo.engine.batching.pack_micro_batches`); the
        result is in the input's row order either way."""
        from hacpo.engine.batching import pack_micro_batches

        B, S = input_ids.shape
        if (positions is None) != (mask is None):
            raise ValueError("pass positions and mask together")
        mbs = micro_batch_size or B
        if mbs < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {mbs}")
        if positions is None:
            lens = [S] * B
        else:
            # causal: nothing after the last scored position changes the scored log-probs
            last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1)
            lens = (last.values + 1).clamp(min=1).tolist() if B else []
            if lens and max(lens) > S:
                raise ValueError(f"positions must lie in [0, {S}), got {max(lens) - 1}")
        if micro_batch_tokens is not None:     # by the padded tokens forward() will run
            groups = pack_micro_batches([self.padded_length(n) for n in lens],
                                        micro_batch_tokens, mbs)
        else:
            groups = [list(range(i, min(i + mbs, B))) for i in range(0, B, mbs)]
        mbs_list = []
        for g in groups:
            idx, s = torch.tensor(g), max(lens[j] for j in g)
            mb = {"input_ids": input_ids[idx, :s], "targets": targets[idx, :s]}
            if positions is not None:
                mb.update(positions=positions[idx], positions_mask=mask[idx])
            mbs_list.append(mb)
        self.model.eval()
        out = self._run(mbs_list, forward_only=True, temperature=temperature, loss_fn=None)
        lp = None
        if self.par.last_stage:
            got = torch.cat([o["logprobs"] for o in out])
            lp = torch.empty_like(got)
            order = torch.tensor([j for g in groups for j in g], device=got.device)
            lp[order] = got                                  # back to the input's row order
        return self._from_last_stage(lp, (B, S if positions is None else positions.shape[1]))

    # -- training -------------------------------------------------------------------------------
    def build_optimizer(self, *, lr: float, optimizer: str = "adam", weight_decay: float = 0.0,
                        adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
                        sgd_momentum: float = 0.0, clip_grad: float = 0.0,
                        use_distributed_optimizer: bool = False,
                        loss_scale: float | None = None, initial_loss_scale: float = 2.0 ** 32):
        """Wrap the model in megatron's DistributedDataParallel and return megatron's optimizer
        (``get_megatron_optimizer``, fp32 params: its ``FP32Optimizer`` around torch's
        AdamW/SGD when neither TE nor apex is installed).

        ``use_distributed_optimizer=True``: megatron's ``DistributedOptimizer`` (ZeRO-1): each
        DP rank keeps the optimizer state (and, for fp16 / bf16 weights, the fp32 main weights)
        of a 1/dp slice of the parameters; gradients are reduce-scattered over DP instead of
        all-reduced and the updated slices all-gathered. Same update. Its ``state_dict()``
        leaves the per-slice state out: checkpoint it with :meth:`optimizer_state`. It checks
        that the parameters are CUDA tensors by name (``Tensor.type()``); on CPU the test
        helper tests/megatron/_cpu_megatron.py maps that name as it maps megatron's other CUDA
        calls.

        fp16 weights: megatron's loss scaler (``loss_scale``: a constant scale, e.g. 1.0 for
        none; None: its dynamic scaler from ``initial_loss_scale``, halved after overflows).
        The schedule's backward multiplies each micro-batch's loss by the scale
        (``config.grad_scale_func``, megatron's ``scale_loss``) and the optimizer divides the
        gradients by it before clipping and stepping (without the first, the gradients would
        be 1/scale of their value); a dynamic scaler's overflow skips the step (see
        :meth:`train_step`). fp32 / bf16 weights have no scaler (scale 1).
        """
        require_megatron()
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        module = self.module
        cfg = module.config
        cfg.calculate_per_token_loss = True      # gradients summed over micro-batches and DP
        # the loss already holds the global divisor: no extra 1/num_tokens scaling
        cfg.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: \
            finalize_model_grads(chunks, None, **kw)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer)
        self.model = DistributedDataParallel(cfg, ddp_cfg, module)
        cfg.no_sync_func = self.model.no_sync
        opt_cfg = OptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                                  adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
                                  sgd_momentum=sgd_momentum, clip_grad=clip_grad,
                                  bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=cfg.params_dtype,
                                  use_distributed_optimizer=use_distributed_optimizer,
                                  loss_scale=loss_scale, initial_loss_scale=initial_loss_scale)
        opt = get_megatron_optimizer(opt_cfg, [self.model])
        # the schedule's backward scales each loss by the optimizer's loss scale, which the
        # optimizer divides the gradients by (fp16); 1 for fp32 / bf16
        cfg.grad_scale_func = opt.scale_loss
        inner = sorted({f"{type(o.optimizer).__module__}.{type(o.optimizer).__qualname__}"
                        for o in chained(opt)})
        # megatron-core picks TE's FusedAdam, else apex's, else torch's: say which ran
        log.info("megatron optimizer %s (distributed=%s) over %s", optimizer,
                 use_distributed_optimizer, ", ".join(inner))
        return opt

    def optimizer_state(self, optimizer) -> dict:
        """This rank's optimizer state (a checkpoint shard for :meth:`load_optimizer_state`),
        with ``"params"``: what each parameter the torch optimizer steps is
        (:meth:`param_entries`), so that :func:`named_moments` can read the state by parameter
        name and a resume can move it to another layout.

        The plain optimizer: ``{"plain": megatron's state_dict(), "params": ...,
        "fp32_params": ...}``; for fp16 / bf16 weights (megatron's Float16Optimizer), whose
        state_dict holds the fp32 main weights of the 16-bit parameters, "fp32_params" holds
        the parameters that are fp32 themselves (megatron keeps e.g. the norms' weights in
        fp32), per chained optimizer, per group, in order (None per FP32Optimizer): the
        checkpoint's HF weights hold them in the policy's dtype only. The distributed
        optimizer, whose ``state_dict()`` holds no parameter state (megatron saves
        that through a separate call that gathers it on DP rank 0): ``{"distributed": ...,
        "params": ...}``, per optimizer of the chain the torch optimizer's state over this
        rank's parameter slices (Adam moments, step), those slices' fp32 main weights (views of
        the weights for fp32 weights; the only full-precision copy for fp16 / bf16) and, for
        fp16, the loss scaler's state."""
        entries = self.param_entries(optimizer)
        opts = _distributed(optimizer)
        if opts is None:
            return {"plain": optimizer.state_dict(), "params": entries,
                    "fp32_params": [None if own is None else
                                    [[p.detach().clone() for p in g] for g in own]
                                    for own in _fp32_params(optimizer, entries)]}
        return {"distributed": [{"optimizer": o.optimizer.state_dict(),
                                 "main_params": [[p.detach().clone() for p in g["params"]]
                                                 for g in o.optimizer.param_groups],
                                 **({"grad_scaler": o.grad_scaler.state_dict()}
                                    if getattr(o, "grad_scaler", None) else {})}
                                for o in opts], "params": entries}

    def param_entries(self, optimizer) -> list | None:
        """What each parameter the torch optimizer steps is, per chained optimizer, per group,
        in ``param_groups`` order: ``{"name": the megatron name of its model parameter,
        "shape": that parameter's shape, "range": [start, end) of the parameter's flattened
        elements it holds (the distributed optimizer's slice of this DP rank) or None (all of
        them), "main": whether it is a separate fp32 copy of fp16 / bf16 weights}``. None for
        an optimizer other than megatron's FP32Optimizer, Float16OptimizerWithFloat16Params or
        DistributedOptimizer."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import (Float16OptimizerWithFloat16Params,
                                                       FP32Optimizer)

        name_of = {id(p): k for k, p in self.module.named_parameters()}

        def entry(model_param, rng=None, main=False) -> dict:
            return {"name": name_of[id(model_param)], "shape": list(model_param.shape),
                    "range": rng, "main": main}

        out = []
        for o in chained(optimizer):
            groups = o.optimizer.param_groups
            if isinstance(o, DistributedOptimizer):
                entries = [[None] * len(g["params"]) for g in groups]
                for prm, (gi, go) in o.model_param_group_index_map.items():
                    r = o._get_model_param_range_map(prm)["param"]
                    entries[gi][go] = entry(prm, [r.start, r.end],
                                            prm.dtype in (torch.float16, torch.bfloat16))
                if any(e is None for g in entries for e in g):
                    raise RuntimeError("megatron's distributed optimizer steps a parameter its "
                                       "model_param_group_index_map does not name")
            elif isinstance(o, Float16OptimizerWithFloat16Params):
                model_of = {id(main): prm for g16, g32 in zip(o.float16_groups,
                                                              o.fp32_from_float16_groups)
                            for prm, main in zip(g16, g32)}
                entries = [[entry(model_of[id(p)], main=True) if id(p) in model_of else entry(p)
                            for p in g["params"]] for g in groups]
            elif isinstance(o, FP32Optimizer):
                entries = [[entry(p) for p in g["params"]] for g in groups]
            else:
                return None
            out.append(entries)
        return out

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        """Load what :meth:`optimizer_state` returned (into an optimizer of the same layout,
        after the weights; a bare megatron state dict, as checkpoints before the names held,
        too). A state of the other kind, or slices of other shapes (another layout), is a
        clear error: another layout's state moves through :func:`named_moments` and
        :meth:`load_named_moments`."""
        opts = _distributed(optimizer)
        if (opts is not None) != ("distributed" in state):
            raise ValueError("the optimizer state was written " +
                             ("without" if opts is not None else "with") + " megatron's "
                             "distributed optimizer, which this optimizer " +
                             ("is" if opts is not None else "is not"))
        if opts is None:
            optimizer.load_state_dict(state["plain"] if "plain" in state else state)
            if state.get("fp32_params"):           # fp32 parameters of a 16-bit model
                have = [p for own in _fp32_params(optimizer, self.param_entries(optimizer))
                        if own is not None for g in own for p in g]
                got = [t for own in state["fp32_params"] if own is not None
                       for g in own for t in g]
                if [tuple(p.shape) for p in have] != [tuple(t.shape) for t in got]:
                    raise ValueError("the optimizer state's fp32 parameters do not match this "
                                     "optimizer's: written with another layout")
                with torch.no_grad():
                    for p, t in zip(have, got):
                        p.copy_(t)
            return
        saved = state["distributed"]
        if len(saved) != len(opts):
            raise ValueError(f"the optimizer state holds {len(saved)} optimizers, this "
                             f"optimizer chains {len(opts)}")
        for o, s in zip(opts, saved):
            mains = [p for g in o.optimizer.param_groups for p in g["params"]]
            got = [t for g in s["main_params"] for t in g]
            have = [tuple(p.shape) for p in mains]
            if have != [tuple(t.shape) for t in got]:
                raise ValueError(f"the optimizer state's parameter slices "
                                 f"{[tuple(t.shape) for t in got]} are not this rank's {have}: "
                                 f"written with another layout")
            o.optimizer.load_state_dict(s["optimizer"])
            with torch.no_grad():
                for p, t in zip(mains, got):
                    p.copy_(t)
            if getattr(o, "grad_scaler", None) and "grad_scaler" in s:
                o.grad_scaler.load_state_dict(s["grad_scaler"])
        _weights_from_slices(opts)

    def load_named_moments(self, optimizer, moments: dict[str, dict[str, torch.Tensor]],
                           grad_scalers: Sequence[dict | None] | None = None) -> int:
        """Set the optimizer's state from whole-parameter states by megatron name
        (:func:`named_moments` of another layout's shards, moved to this rank's shards:
        ``{name: {"step", "exp_avg", "exp_avg_sq"[, "main"]}}``, "main": the full-precision
        weights of a model with fp16 / bf16 weights, copied into the fp32 main weights or, for
        its fp32 parameters, the parameters), for any of megatron's plain or distributed
        optimizers (each DP rank of the distributed one takes its slice), whose inner optimizer
        is torch's Adam / AdamW (the step per parameter) or TE's / apex's FusedAdam (the step
        per parameter group). Every parameter must have a state of its shape, and fp16 / bf16
        weights their main weights.
        ``grad_scalers``: per chained optimizer, the loss scaler's state (fp16) to load. Returns
        the number of parameters set."""
        entries = self.param_entries(optimizer)
        if entries is None:
            raise ValueError("optimizer state moves to another layout only for megatron's "
                             "FP32Optimizer, Float16OptimizerWithFloat16Params and "
                             "DistributedOptimizer")
        opts = chained(optimizer)
        n = 0
        for o, groups in zip(opts, entries):
            # torch's Adam / AdamW keep the step per parameter; TE's and apex's FusedAdam (which
            # megatron-core uses when either is installed) per parameter group
            per_group = not isinstance(o.optimizer, (torch.optim.Adam, torch.optim.AdamW))
            for g, group_entries in zip(o.optimizer.param_groups, groups):
                for prm, e in zip(g["params"], group_entries):
                    name, rng = e["name"], e["range"]
                    st = moments.get(name)
                    if st is None:
                        raise ValueError(f"no optimizer state for parameter {name!r}")
                    if tuple(st["exp_avg"].shape) != tuple(e["shape"]):
                        raise ValueError(f"optimizer state of {name!r} has shape "
                                         f"{tuple(st['exp_avg'].shape)}, the parameter "
                                         f"{tuple(e['shape'])}")
                    if e["main"] and "main" not in st:
                        raise ValueError(f"the optimizer state of {name!r} holds no fp32 main "
                                         f"weights, which its fp16 / bf16 weights need")

                    def cut(t: torch.Tensor, rng=rng) -> torch.Tensor:
                        return t.reshape(-1)[rng[0]:rng[1]] if rng is not None else t

                    o.optimizer.state[prm] = {
                        k: (v.detach().clone() if k == "step" else
                            cut(v).detach().clone().to(prm.device))
                        for k, v in st.items() if k != "main" and not (per_group and k == "step")}
                    if per_group:
                        g["step"] = int(round(float(st["step"])))
                    if "main" in st:         # the main copy, or an fp32 parameter itself
                        with torch.no_grad():
                            prm.copy_(cut(st["main"]).reshape(prm.shape))
                    n += 1
        if _distributed(optimizer) is not None:
            _weights_from_slices(opts)
        if grad_scalers is not None:
            if len(grad_scalers) != len(opts):
                raise ValueError(f"{len(grad_scalers)} loss scaler states for {len(opts)} "
                                 f"chained optimizers")
            for o, sc in zip(opts, grad_scalers):
                if getattr(o, "grad_scaler", None) and sc is not None:
                    o.grad_scaler.load_state_dict(sc)
        return n

    def train_step(self, optimizer, microbatches: Sequence[dict], loss_fn: LossFn, *,
                   temperature: float = 1.0) -> list[dict]:
        """One optimizer step over ``microbatches`` (this DP rank's share of the minibatch).

        Each micro-batch dict holds ``input_ids`` and ``targets`` [b, S] plus whatever
        ``loss_fn(token_logp [b, S], mb) -> (loss, metrics)`` needs; the loss must be divided by
        the global divisor already (see the module docstring). With ``positions`` and
        ``positions_mask`` [b, T] in the dict, token_logp is [b, T]: only those positions
        (:meth:`logprobs_at`). Returns the per-micro-batch
        metrics on the last PP stage (empty elsewhere), each with ``step_skipped`` (bool) and
        ``loss_scale`` (float: the fp16 loss scale for the next step, 1.0 without a scaler)
        added; every rank also finds them, with ``grad_norm``, in :attr:`last_step`.

        fp16 with megatron's dynamic loss scaler (``build_optimizer(loss_scale=None)``): as in
        megatron, gradients that overflow at the current scale skip the step (the weights and
        the optimizer state stay as they were, ``step_skipped`` is True) and the scaler lowers
        the scale (halved after ``hysteresis`` = 2 overflows in a row, then at each one), as
        is normal for the first steps from the default 2^32.

        Errors (a RuntimeError, the weights, the optimizer state and the loss scale unchanged),
        when the gradients are non-finite: a non-finite loss of any micro-batch on any rank
        behind them (whatever the scaler; a non-finite loss whose gradients are finite, e.g.
        a NaN in a detached term, is not looked for: the step is taken); non-finite
        gradients without a dynamic scaler (fp32 / bf16, or a constant fp16 ``loss_scale``;
        megatron's fp32 / bf16 optimizers would step on NaN gradients and write NaN into every
        weight). Otherwise the gradients are clipped to the optimizer's ``clip_grad``
        (coefficient ``clip_grad / (norm + 1e-6)`` where below 1, as megatron's clip; the norm
        is megatron's global fp32 norm of its fp32 main gradients, finite above fp16's 65504)
        and the optimizer steps.
        """
        self.model.train()
        self.model.zero_grad_buffer()
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        out = self._run(microbatches, forward_only=False, temperature=temperature,
                        loss_fn=loss_fn, losses=losses)
        self.model.eval()
        opts = chained(optimizer)
        scalers = [o.grad_scaler for o in opts if getattr(o, "grad_scaler", None) is not None]
        saved = [_scaler_state(sc) for sc in scalers]
        # megatron's step(), with the grad norm checked before anything is stepped (its fp32 /
        # bf16 optimizers would step on NaN gradients and write NaN into every weight)
        overflow = optimizer.prepare_grads()     # main_grad -> grad (fp16: unscaled, checked;
        grad_norm = float(optimizer.get_grad_norm())   # the scaler updated)
        skipped = bool(overflow) or not math.isfinite(grad_norm)
        if skipped:
            optimizer.zero_grad()
            bad = self._nonfinite_loss(losses)    # the same on every rank (a collective)
            dynamic = bool(scalers) and all(_is_dynamic(sc) for sc in scalers)
            if bad is not None or not (overflow and dynamic):
                for sc, st in zip(scalers, saved):
                    sc.load_state_dict(st)       # an error changes nothing, the scale neither
                what = (f"non-finite loss ({bad})" if bad is not None else
                        f"the fp16 loss scaler (constant scale "
                        f"{float(optimizer.get_loss_scale())}) found inf/NaN gradients"
                        if overflow else f"non-finite gradients (grad norm {grad_norm})")
                raise RuntimeError(f"megatron optimizer step was skipped: {what}; the weights, "
                                   f"the optimizer state and the loss scale are unchanged")
        else:
            clip = optimizer.config.clip_grad
            if clip > 0 and clip / (grad_norm + 1e-6) < 1:
                with torch.no_grad():
                    for o in opts:
                        for prm in o.get_parameters():
                            if prm.grad is not None:
                                prm.grad.mul_(clip / (grad_norm + 1e-6))
            optimizer.step_with_ready_grads()
        scale = float(optimizer.get_loss_scale()) if scalers else 1.0
        self.last_step = {"step_skipped": skipped, "loss_scale": scale, "grad_norm": grad_norm}
        for m in out:
            m.update(step_skipped=skipped, loss_scale=scale)
        return out

    def _nonfinite_loss(self, losses: list[torch.Tensor]) -> str | None:
        """Whether a micro-batch's loss on any rank of this model is non-finite (only the last
        PP stage computes losses): a description, or None. A collective over TP, PP and DP."""
        bad = [(i, float(v)) for i, v in enumerate(losses) if not math.isfinite(float(v))]
        device = next(self.module.parameters()).device
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        for group, size in ((self.par.tp_group, self.par.tp), (self.par.pp_group, self.par.pp),
                            (self.par.dp_group, self.par.dp)):
            if size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag.item():
            return None
        if bad:
            return f"{bad[0][1]} in micro-batch {bad[0][0]} of this rank"
        return "in a micro-batch of another rank"


def _scaler_state(scaler) -> dict:
    """A copy of a megatron grad scaler's state (its scale tensor is replaced, not updated in
    place, but copy it anyway)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in scaler.state_dict().items()}


def _is_dynamic(scaler) -> bool:
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    return isinstance(scaler, DynamicGradScaler)


def chained(optimizer) -> list:
    """The optimizers a megatron optimizer chains (``[optimizer]`` if it chains none)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed(optimizer) -> list | None:
    """The optimizers chained in ``optimizer`` if they are megatron's distributed optimizers,
    None if none is (a mix is an error)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = chained(optimizer)
    kinds = {isinstance(o, DistributedOptimizer) for o in opts}
    if len(kinds) > 1:
        raise ValueError("a chain of distributed and other megatron optimizers is not supported")
    return opts if kinds == {True} else None


def _fp32_params(optimizer, entries: list | None) -> list:
    """The parameters a Float16Optimizer steps themselves (not through an fp32 main copy: the
    fp32 ones of a 16-bit model), per chained optimizer (None for one of another kind), per
    group, in order; ``entries``: :meth:`MegatronPolicy.param_entries`."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if entries is None:
        return [None] * len(chained(optimizer))
    return [[[p for p, e in zip(g["params"], ents) if not e["main"]]
             for g, ents in zip(o.optimizer.param_groups, groups)]
            if isinstance(o, Float16OptimizerWithFloat16Params) else None
            for o, groups in zip(chained(optimizer), entries)]


def _weights_from_slices(opts: list) -> None:
    """After the distributed optimizers' slices were set: every DP rank's slices of the main
    weights into its weights, then all-gathered over DP (as after a step), so every rank holds
    them whole (the fp32 parameters of a 16-bit model are known in full precision only to the
    rank that steps each slice). A collective over DP."""
    for o in opts:
        o._copy_main_params_to_model_params()
    for chunk in {id(c): c for o in opts for c in o.model_chunks}.values():
        chunk.start_param_sync(force_sync=True)


def _shard_entries(state: dict) -> list | None:
    """A shard's parameter entries (``MegatronPolicy.param_entries``); shards written before
    them name fp32 whole parameters only (``"names"``); None where a shard names none."""
    if state.get("params") is not None:
        return state["params"]
    if state.get("names") is not None:
        return [[[{"name": n, "range": None, "main": False} for n in g] for g in o]
                for o in state["names"]]
    return None


def named_moments(state: dict) -> dict[str, dict[str, torch.Tensor]] | None:
    """An optimizer shard of :meth:`MegatronPolicy.optimizer_state` -> its per-parameter states
    by megatron name: ``{name: {"step", "exp_avg", "exp_avg_sq", ...}}`` plus ``"main"`` (the
    full-precision weights: the fp32 main weights of 16-bit parameters, the fp32 parameters
    themselves) in a model with fp16 / bf16 weights, and for the distributed optimizer's slices
    ``"range"`` (of the flattened parameter) and ``"shape"`` (of the whole parameter; see
    :func:`join_slices`); "step" is the parameter group's for optimizers that keep it there
    (TE's / apex's FusedAdam). Parameters without state (no step has run) are left out. None for a
    shard that names no parameters (written before the names, or by another optimizer)."""
    entries = _shard_entries(state)
    if entries is None:
        return None
    if "distributed" in state:
        # the slices' fp32 main weights: for every parameter (views of fp32 parameters)
        per_opt = [(s["optimizer"], s["main_params"], None) for s in state["distributed"]]
    elif "plain" in state:
        sds = state["plain"] if isinstance(state["plain"], list) else [state["plain"]]
        fp32 = state.get("fp32_params") or [None] * len(sds)
        if len(fp32) != len(sds):
            raise ValueError("the optimizer shard's fp32 parameters do not match its optimizers")
        # Float16Optimizer: {"optimizer", "fp32_from_fp16_params" (the main weights, per group,
        # in the order of its fp16 parameters)[, "grad_scaler"]} and, from optimizer_state, its
        # fp32 parameters likewise; FP32Optimizer: torch's own state dict
        per_opt = [(sd["optimizer"], sd["fp32_from_fp16_params"], f)
                   if "fp32_from_fp16_params" in sd else (sd, None, None)
                   for sd, f in zip(sds, fp32)]
    else:
        return None
    if len(per_opt) != len(entries):
        raise ValueError(f"the optimizer shard names {len(entries)} optimizers and holds "
                         f"{len(per_opt)}")
    out = {}
    # the distributed optimizer's main slices of fp32 parameters are views of the weights,
    # which the checkpoint's HF weights hold exactly in an fp32 model: needed in a 16-bit one
    sliced_mains = "distributed" in state and any(e["main"] for o in entries for g in o
                                                  for e in g)
    for (inner, mains, fp32), groups in zip(per_opt, entries):
        if len(inner["param_groups"]) != len(groups):
            raise ValueError("the optimizer shard's names do not match its parameter groups")
        for gi, (g, group_entries) in enumerate(zip(inner["param_groups"], groups)):
            if len(g["params"]) != len(group_entries):
                raise ValueError("the optimizer shard's names do not match its parameter groups")
            j = k = 0                  # the next 16-bit parameter's main, fp32 parameter
            for i, (idx, e) in enumerate(zip(g["params"], group_entries)):
                main = None
                if sliced_mains:
                    main = mains[gi][i]
                elif mains is not None and e["main"]:
                    main = mains[gi][j]
                    j += 1
                elif mains is not None and fp32 is not None:
                    main = fp32[gi][k]
                    k += 1
                if idx not in inner["state"]:
                    continue
                st = dict(inner["state"][idx])
                if "step" not in st and "step" in g:    # TE's / apex's FusedAdam: per group
                    st["step"] = torch.tensor(float(g["step"]))
                if main is not None:
                    st["main"] = main
                if e["range"] is not None:
                    st["range"], st["shape"] = tuple(e["range"]), tuple(e["shape"])
                out[e["name"]] = st
    return out


def grad_scaler_states(state: dict) -> list[dict | None]:
    """An optimizer shard's loss scaler state per chained optimizer (fp16; None without)."""
    if "distributed" in state:
        return [s.get("grad_scaler") for s in state["distributed"]]
    sds = state["plain"] if isinstance(state.get("plain"), list) else [state.get("plain", state)]
    return [sd.get("grad_scaler") if isinstance(sd, dict) else None for sd in sds]


def moments_of_layout(named: Sequence[tuple[tuple[int, int, int], dict]], tp: int, pp: int, *,
                      sliced: bool, arch: ArchSpec, transformer_impl: str = "local"
                      ) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    """The per-parameter states of one layout's ranks (``named``: ((tp_rank, pp_rank,
    dp_rank), :func:`named_moments` of that rank's shard) pairs) -> :func:`moments_to_hf`'s
    (step, {moment: full HF-named tensors}): DP rank 0's shard of every (tp, pp) pair, or with
    the distributed optimizer (``sliced``) all its DP ranks' slices joined
    (:func:`join_slices`). Other DP ranks' shards are ignored without ``sliced``."""
    from hacpo.models.megatron.convert import moments_to_hf

    parts: list[list[list[dict]]] = [[[] for _ in range(tp)] for _ in range(pp)]
    for (tp_rank, pp_rank, dp_rank), states in named:
        if sliced or not dp_rank:
            parts[pp_rank][tp_rank].append(states)
    return moments_to_hf([[join_slices(p) if sliced else p[0] for p in row] for row in parts],
                         arch, transformer_impl=transformer_impl)


def join_slices(parts: Sequence[dict[str, dict[str, torch.Tensor]]]
                ) -> dict[str, dict[str, torch.Tensor]]:
    """The distributed optimizer's per-parameter slices from the DP ranks of one (tp, pp) shard
    (:func:`named_moments` of each rank's shard: 1-D slices with their "range" in the flattened
    parameter and its "shape") -> whole-parameter states ``{name: {"step", "exp_avg",
    "exp_avg_sq"[, "main"]}}``, each tensor of the parameter's shape. The slices of a
    parameter must cover its elements exactly once, with the same keys and step."""
    pieces: dict[str, list[dict]] = {}
    for part in parts:
        for name, st in part.items():
            if "range" not in st:
                raise ValueError(f"the optimizer state of {name!r} is not a slice")
            pieces.setdefault(name, []).append(st)
    out = {}
    for name, sts in pieces.items():
        sts = sorted(sts, key=lambda s: s["range"][0])
        shape = tuple(sts[0]["shape"])
        numel = math.prod(shape)
        pos = 0
        for s in sts:
            a, b = s["range"]
            if a != pos or b < a or tuple(s["shape"]) != shape:
                pos = -1
                break
            pos = b
        if pos != numel:
            raise ValueError(f"the optimizer slices of {name!r} cover "
                             f"{[tuple(s['range']) for s in sts]} of its {numel} elements")
        keys = set(sts[0]) - {"range", "shape"}
        if any(set(s) - {"range", "shape"} != keys for s in sts):
            raise ValueError(f"the optimizer slices of {name!r} hold different states")
        if len({float(s["step"]) for s in sts}) != 1:
            raise ValueError(f"the optimizer slices of {name!r} are at different steps")
        rec = {"step": sts[0]["step"]}
        for key in sorted(keys - {"step"}):
            parts_ = [s[key].reshape(-1) for s in sts]
            if [t.numel() for t in parts_] != [s["range"][1] - s["range"][0] for s in sts]:
                raise ValueError(f"the optimizer slices of {name!r} ({key}) do not have their "
                                 f"ranges' lengths")
            rec[key] = torch.cat(parts_).reshape(shape)
        out[name] = rec
    return out
