"""A megatron-core TP/PP/DP policy: per-token log-probs and one optimizer step.

    par = init_parallel(tp=2, pp=1)
    pol = MegatronPolicy.from_hf(hf_model, par)            # builds GPTModel, loads this shard
    lp = pol.token_logprobs(input_ids, targets)            # [B, S] float32 on every rank
    lp = pol.token_logprobs(input_ids, targets, positions=pos, mask=m)   # [B, T]: only those
    opt = pol.build_optimizer(lr=1e-5)                     # megatron DDP + megatron optimizer
    metrics = pol.train_step(opt, microbatches, loss_fn)   # loss_fn(lp, mb) -> (loss, metrics)

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

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


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
        model = build_gpt_model(arch, par, transformer_impl=transformer_impl,
                                params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                recompute=recompute)
        state = hf_to_megatron(hf_model.state_dict(), arch, tp=par.tp, tp_rank=par.tp_rank,
                               pp=par.pp, pp_rank=par.pp_rank, transformer_impl=transformer_impl)
        load_megatron_state(model, state)
        return cls(model, arch, par, transformer_impl, logprob_backend=logprob_backend,
                   lm_head=lm_head)

    # -- weights --------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (unwrapped from megatron DDP)."""
        return getattr(self.model, "module", self.model)

    def local_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.module.state_dict().items()
                if isinstance(v, torch.Tensor)}

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

    def _forward_step(self, temperature: float, loss_fn: LossFn | None, data_iterator, model):
        mb = next(data_iterator)
        out = self.forward(model, mb["input_ids"])

        def loss_func(output):
            lp = self.logprobs_at(output, mb["targets"], mb.get("positions"),
                                  mb.get("positions_mask"), temperature)
            if loss_fn is None:
                return lp.sum() * 0.0, torch.ones((), dtype=torch.int), {"logprobs": lp.detach()}
            loss, metrics = loss_fn(lp, mb)
            return loss, torch.ones((), dtype=torch.int), {"logprobs": lp.detach(), **metrics}

        return out, loss_func

    def _run(self, microbatches: Sequence[dict], *, forward_only: bool, temperature: float,
             loss_fn: LossFn | None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shapes = [tuple(mb["input_ids"].shape) for mb in microbatches]
        if self.par.pp > 1 and not self.module.config.variable_seq_lengths and \
                len(set(shapes)) > 1:
            raise ValueError(f"micro-batches of different shapes {sorted(set(shapes))} need "
                             f"the model config's variable_seq_lengths at PP > 1")
        fb = get_forward_backward_func()
        return fb(forward_step_func=partial(self._forward_step, temperature, loss_fn),
                  data_iterator=iter(microbatches), model=[self.model],
                  num_microbatches=len(microbatches), seq_length=max(s for _, s in shapes),
                  micro_batch_size=max(b for b, _ in shapes), forward_only=forward_only)

    def _from_last_stage(self, t: torch.Tensor | None, shape) -> torch.Tensor:
        """Broadcast a tensor that exists on the last PP stage to every stage."""
        if self.par.pp == 1:
            return t
        buf = t.contiguous() if t is not None else torch.empty(shape, dtype=torch.float32)
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
                        use_distributed_optimizer: bool = False):
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
                                  use_distributed_optimizer=use_distributed_optimizer)
        return get_megatron_optimizer(opt_cfg, [self.model])

    def optimizer_state(self, optimizer) -> dict:
        """This rank's optimizer state (a checkpoint shard for :meth:`load_optimizer_state`).

        ``{"plain": megatron's state_dict(), "names": ...}``: with fp32 weights (megatron's
        ``FP32Optimizer``: the torch optimizer steps the weights themselves) ``names`` lists
        the megatron name of every parameter in the torch optimizer's order (per chained
        optimizer, per group), so :func:`named_moments` can read the state by name and a
        resume can move it to another layout; None otherwise. For the distributed optimizer,
        whose ``state_dict()`` holds no parameter state (megatron saves that through a
        separate call that gathers it on DP rank 0): ``{"distributed": ...}``, per optimizer of
        the chain the torch optimizer's state over this rank's parameter slices (Adam moments,
        step) and those slices' fp32 main weights (views of the weights for fp32 weights; the
        only full-precision copy for fp16 / bf16)."""
        opts = _distributed(optimizer)
        if opts is None:
            return {"plain": optimizer.state_dict(), "names": self._optimizer_names(optimizer)}
        return {"distributed": [{"optimizer": o.optimizer.state_dict(),
                                 "main_params": [[p.detach().clone() for p in g["params"]]
                                                 for g in o.optimizer.param_groups]}
                                for o in opts]}

    def _optimizer_names(self, optimizer) -> list | None:
        """[[[megatron name of each parameter] per group] per chained optimizer], if every
        chained optimizer steps the model's parameters themselves (fp32); else None."""
        from megatron.core.optimizer.optimizer import FP32Optimizer

        opts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        if not all(isinstance(o, FP32Optimizer) for o in opts):
            return None
        name_of = {id(p): k for k, p in self.module.named_parameters()}
        return [[[name_of[id(p)] for p in g["params"]] for g in o.optimizer.param_groups]
                for o in opts]

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        """Load what :meth:`optimizer_state` returned (into an optimizer of the same layout,
        after the weights; a bare megatron state dict, as checkpoints before the names held,
        too). A state of the other kind, or slices of other shapes (another layout), is a
        clear error."""
        opts = _distributed(optimizer)
        if (opts is not None) != ("distributed" in state):
            raise ValueError("the optimizer state was written " +
                             ("without" if opts is not None else "with") + " megatron's "
                             "distributed optimizer, which this optimizer " +
                             ("is" if opts is not None else "is not"))
        if opts is None:
            optimizer.load_state_dict(state["plain"] if "plain" in state else state)
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

    def load_named_moments(self, optimizer, moments: dict[str, dict[str, torch.Tensor]]
                           ) -> int:
        """Set the state of a plain fp32 optimizer from per-parameter states by megatron name
        (:func:`named_moments` of another layout's shards, moved to this rank's shards:
        ``{name: {"step", "exp_avg", "exp_avg_sq"}}``). Every parameter must have one, of its
        shape. Returns the number of parameters set."""
        names = self._optimizer_names(optimizer)
        if names is None or _distributed(optimizer) is not None:
            raise ValueError("optimizer state can be moved to another layout only for "
                             "megatron's plain optimizer over fp32 weights")
        n = 0
        for o, groups in zip(getattr(optimizer, "chained_optimizers", [optimizer]), names):
            for g, group_names in zip(o.optimizer.param_groups, groups):
                for prm, name in zip(g["params"], group_names):
                    st = moments.get(name)
                    if st is None:
                        raise ValueError(f"no optimizer state for parameter {name!r}")
                    if tuple(st["exp_avg"].shape) != tuple(prm.shape):
                        raise ValueError(f"optimizer state of {name!r} has shape "
                                         f"{tuple(st['exp_avg'].shape)}, the parameter "
                                         f"{tuple(prm.shape)}")
                    o.optimizer.state[prm] = {
                        k: (v.detach().clone().to(prm.device) if k != "step" else
                            v.detach().clone()) for k, v in st.items()}
                    n += 1
        return n

    def train_step(self, optimizer, microbatches: Sequence[dict], loss_fn: LossFn, *,
                   temperature: float = 1.0) -> list[dict]:
        """One optimizer step over ``microbatches`` (this DP rank's share of the minibatch).

        Each micro-batch dict holds ``input_ids`` and ``targets`` [b, S] plus whatever
        ``loss_fn(token_logp [b, S], mb) -> (loss, metrics)`` needs; the loss must be divided by
        the global divisor already (see the module docstring). With ``positions`` and
        ``positions_mask`` [b, T] in the dict, token_logp is [b, T]: only those positions
        (:meth:`logprobs_at`). Returns the per-micro-batch
        metrics on the last PP stage (empty elsewhere).
        """
        self.model.train()
        self.model.zero_grad_buffer()
        optimizer.zero_grad()
        out = self._run(microbatches, forward_only=False, temperature=temperature,
                        loss_fn=loss_fn)
        ok, _grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (non-finite gradients)")
        self.model.eval()
        return out


def _distributed(optimizer) -> list | None:
    """The optimizers chained in ``optimizer`` if they are megatron's distributed optimizers,
    None if none is (a mix is an error)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    kinds = {isinstance(o, DistributedOptimizer) for o in opts}
    if len(kinds) > 1:
        raise ValueError("a chain of distributed and other megatron optimizers is not supported")
    return opts if kinds == {True} else None


def named_moments(state: dict) -> dict[str, dict[str, torch.Tensor]] | None:
    """A plain optimizer shard of :meth:`MegatronPolicy.optimizer_state` -> its per-parameter
    states by megatron name (``{name: {"step", "exp_avg", "exp_avg_sq", ...}}``); None for a
    shard without names (the distributed optimizer, fp16 / bf16 weights, or a checkpoint from
    before the names)."""
    if "plain" not in state or state.get("names") is None:
        return None
    sds = state["plain"] if isinstance(state["plain"], list) else [state["plain"]]
    if len(sds) != len(state["names"]):
        raise ValueError(f"the optimizer shard names {len(state['names'])} optimizers and "
                         f"holds {len(sds)}")
    out = {}
    for sd, groups in zip(sds, state["names"]):
        for g, group_names in zip(sd["param_groups"], groups):
            if len(g["params"]) != len(group_names):
                raise ValueError("the optimizer shard's names do not match its parameter groups")
            for idx, name in zip(g["params"], group_names):
                if idx in sd["state"]:
                    out[name] = dict(sd["state"][idx])
    return out
