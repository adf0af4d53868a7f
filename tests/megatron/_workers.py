"""Tiny HF models and the gloo worker functions of the megatron tests (module level, so that
torch.multiprocessing can spawn them). Every worker writes its result with torch.save; the
test process compares."""
from __future__ import annotations

import contextlib

import torch

ARCHS = ("llama", "qwen2", "qwen3")
B, S = 4, 8           # batch rows and sequence length of the log-prob checks


def tiny_hf(arch: str, *, tie: bool = True, seed: int = 0, layers: int = 2, vocab: int = 96):
    """A random tiny HF causal LM (fp32, eval), with weights scaled up and norm weights away
    from 1 so that a wrong mapping moves log-probs by far more than any tolerance used.
    An odd ``vocab`` makes megatron pad the vocabulary at TP > 1."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    # Qwen3 gets head_dim != hidden/heads (as Qwen3-0.6B: 1024 hidden, 16 x 128 heads) and
    # the Qwens their real rope theta, so that both mappings are exercised.
    cfg = cls(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2,
              head_dim=32 if arch == "qwen3" else 16, vocab_size=vocab,
              max_position_embeddings=64, tie_word_embeddings=tie, rms_norm_eps=1e-6,
              rope_theta=10000.0 if arch == "llama" else 1e6)
    cfg._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:      # qkv biases (Qwen2)
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.float().eval()


def batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    targets = torch.randint(0, vocab, (B, S), generator=g)
    return ids, targets


@torch.no_grad()
def hf_logprobs(model, ids, targets):
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


def case_model(case):
    """A test case (arch, tie) or (arch, tie, vocab) -> its tiny HF model."""
    arch, tie, *vocab = case
    return tiny_hf(arch, tie=tie, **({"vocab": vocab[0]} if vocab else {}))


def _policy(case, tp, pp, dp=None, lm_head="fused", sequence_parallel=False, recompute=None):
    from hacpo.models.megatron import MegatronPolicy, init_parallel

    par = init_parallel(tp, pp, dp)
    hf = case_model(case)
    return hf, MegatronPolicy.from_hf(hf, par, lm_head=lm_head,
                                      sequence_parallel=sequence_parallel, recompute=recompute)


def _count_calls(pol) -> tuple[dict, list]:
    """Forward calls of the first layer's input norm, core attention and MLP (on a rank of the
    first stage): ({name: count}, the hook handles)."""
    layer = pol.module.decoder.layers[0]
    counts = {"norm": 0, "core_attn": 0, "mlp": 0}
    hooks = []
    for name, mod in (("norm", layer.input_layernorm),
                      ("core_attn", layer.self_attention.core_attention), ("mlp", layer.mlp)):
        def hook(m, a, o, name=name):
            counts[name] += 1
        hooks.append(mod.register_forward_hook(hook))
    return counts, hooks


def score_positions(S_: int = S):
    """Positions [B, 3] into a sequence of S_ and their mask (a row with none, one with one):
    what the trainer asks for (the response tokens), here arbitrary."""
    pos = torch.tensor([[S_ - 1, 0, 3], [2, 2, 5], [1, 0, 0], [4, 6, 7]])
    mask = torch.tensor([[True, True, True], [True, False, True], [False, False, False],
                         [True, True, False]])
    return pos, mask


# -- workers: fn(rank, world, *args) ----------------------------------------------------------
def logprobs_worker(rank, world, tp, pp, out_path, cases):
    """For each (arch, tie): load the HF weights into this rank's shard, gather them back, and
    compute log-probs (2 micro-batches). Rank 0 saves {case: (lp, gathered == original)}."""
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron import hf_state_dict

    results = {}
    for case in cases:
        hf, pol = _policy(case, tp, pp)
        ids, targets = batch(pol.arch.vocab_size)
        lp = pol.token_logprobs(ids, targets, micro_batch_size=B // 2)
        ref = hf_state_dict(hf)
        back = pol.hf_state_dict()
        same = back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
        results[case] = (lp, same, hf_logprobs(hf, ids, targets))
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out_path)


def bad_positions_worker(rank, world, out_path):
    """MegatronPolicy's answers to bad scoring requests (in-process, TP=1): rank 0 saves each
    request's ValueError message (None: no error)."""
    hf, pol = _policy(("llama", True), 1, 1)
    ids, targets = batch(pol.arch.vocab_size)
    pos, mask = score_positions()
    calls = [lambda kw=kw: pol.token_logprobs(ids, targets, **kw)
             for kw in (dict(positions=pos), dict(mask=mask), dict(positions=pos + S, mask=mask),
                        dict(positions=pos, mask=mask, micro_batch_size=-1))]
    calls.append(lambda: pol.logprobs_at(torch.zeros(S, B, 64), targets, positions=pos))
    calls.append(lambda: pol.logprobs_at(torch.zeros(S + 1, B, 64), targets))
    torch.save(value_error_messages(calls), out_path)


def value_error_messages(calls) -> list:
    """Each call's ValueError message, None where it raised none."""
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def sgd_loss(lp, mb):
    """A token-level surrogate with the global divisor passed in (SPEC: pass the divisor in)."""
    loss = -(lp * mb["adv"][:, None] * mb["mask"]).sum() / mb["divisor"]
    return loss, {"loss": loss.detach()}


def train_worker(rank, world, arch, micro_rows, optimizers, out_path):
    """For each optimizer name: one megatron optimizer step at TP=1 PP=1 DP=world on this rank's
    rows of a fixed batch of B rows (micro-batches of ``micro_rows``). Rank 0 saves
    {optimizer: (weights before, weights after)}."""
    from megatron.core import parallel_state as ps

    results = {}
    for name in optimizers:
        hf, pol = _policy((arch, True), 1, 1)
        opt = pol.build_optimizer(lr=0.5, optimizer=name)
        ids, targets = batch(pol.arch.vocab_size)
        g = torch.Generator().manual_seed(2)
        adv = torch.randn(B, generator=g)
        mask = torch.rand(B, S, generator=g) < 0.7
        divisor = mask.sum().float()
        lo, hi = rank * B // world, (rank + 1) * B // world
        mbs = [{"input_ids": ids[i:i + micro_rows], "targets": targets[i:i + micro_rows],
                "adv": adv[i:i + micro_rows], "mask": mask[i:i + micro_rows],
                "divisor": divisor} for i in range(lo, hi, micro_rows)]
        before = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        pol.train_step(opt, mbs, sgd_loss)
        results[name] = (before, pol.hf_state_dict())
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out_path)


# -- TP x PP x DP: log-probs, gradients and one optimizer step --------------------------------
def step_batch(vocab: int):
    """The fixed batch of the gradient / training checks: B rows plus a per-row advantage, a
    token mask and the global divisor (number of masked tokens of the whole batch)."""
    ids, targets = batch(vocab)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, S, generator=g) < 0.7
    return ids, targets, adv, mask, mask.sum().float()


def step_microbatches(vocab: int, lo: int, hi: int, micro_rows: int) -> list[dict]:
    """Rows lo..hi-1 of :func:`step_batch` cut into micro-batches of ``micro_rows`` rows."""
    ids, targets, adv, mask, divisor = step_batch(vocab)
    return [{"input_ids": ids[i:i + micro_rows], "targets": targets[i:i + micro_rows],
             "adv": adv[i:i + micro_rows], "mask": mask[i:i + micro_rows], "divisor": divisor}
            for i in range(lo, hi, micro_rows)]


def hf_grads(model) -> dict:
    """Gradients of :func:`sgd_loss` over the whole :func:`step_batch` w.r.t. an HF model's
    weights (HF names, without a tied ``lm_head.weight``): the single-process reference."""
    ids, targets, adv, mask, divisor = step_batch(model.config.vocab_size)
    model.zero_grad()
    logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    loss, _ = sgd_loss(lp, {"adv": adv, "mask": mask, "divisor": divisor})
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _gather_hf(pol, local: dict) -> dict | None:
    """megatron-named tensors of every rank -> HF-named full tensors on rank 0 (DP rank 0's
    shards; None elsewhere). Generic over TP x PP through ``megatron_to_hf``."""
    import torch.distributed as dist

    from hacpo.models.megatron import megatron_to_hf

    p = pol.par
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (p.pp_rank, p.tp_rank, p.dp_rank, local))
    if dist.get_rank() != 0:
        return None
    shards = [[None] * p.tp for _ in range(p.pp)]
    for pp_rank, tp_rank, dp_rank, sd in everyone:
        if dp_rank == 0:
            shards[pp_rank][tp_rank] = sd
    return megatron_to_hf(shards, pol.arch)


def _padding_rows(pol) -> tuple[int, float, float]:
    """Over every rank: (number of padded vocabulary rows held, their largest |main_grad|,
    their largest |weight|) in the embedding and output layer shards (megatron_to_hf drops
    these rows, so the HF-named comparisons cannot see them)."""
    import torch.distributed as dist

    n_real = pol.arch.real_vocab_of_rank(pol.par.tp, pol.par.tp_rank)
    rows, grad, weight = 0, 0.0, 0.0
    for k, p in pol.module.named_parameters():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            rows += p.shape[0] - n_real
            grad = max(grad, p.main_grad[n_real:].abs().max().item() if n_real < p.shape[0]
                       else 0.0)
            weight = max(weight, p.detach()[n_real:].abs().max().item() if n_real < p.shape[0]
                         else 0.0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rows, grad, weight))
    return (sum(r for r, _, _ in everyone), max(g for _, g, _ in everyone),
            max(w for _, _, w in everyone))


def parallel_step_worker(rank, world, tp, pp, micro_rows, cases, optimizers, out_path,
                         lm_head="fused", sequence_parallel=False, recompute=None):
    """At TP=tp, PP=pp, DP=world/(tp*pp), for each (arch, tie) and optimizer name: token
    log-probs (2 micro-batches; "lp_at": only :func:`score_positions`'s) and the gathered
    weights, then one ``train_step`` on this DP
    rank's rows of :func:`step_batch` (micro-batches of ``micro_rows``). Each case is (arch,
    tie) or (arch, tie, vocab). Rank 0 saves {case: {"lp", "same", "before", "grads": {opt:
    HF-named gradients (megatron's main_grad after the step: summed over micro-batches, DP, tied
    copies)}, "after": {opt: HF weights after the step}, "padding": {opt: :func:`_padding_rows`
    after the step}, "norm_inputs": the shapes the first layer's input norm saw in the "lp"
    call, "train_calls": :func:`_count_calls` over the first step}}. ``sequence_parallel`` and
    ``recompute``: passed to ``MegatronPolicy.from_hf``."""
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron import hf_state_dict, hf_units

    results = {}
    for case in cases:
        res = {"grads": {}, "after": {}, "padding": {}}
        for name in optimizers:
            hf, pol = _policy(case, tp, pp, lm_head=lm_head, sequence_parallel=sequence_parallel,
                              recompute=recompute)
            if "lp" not in res:
                ids, targets = batch(pol.arch.vocab_size)
                norm = pol.module.decoder.layers[0].input_layernorm
                seen = []      # what the first norm sees: [S/tp, b, H] under sequence parallel
                hook = norm.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
                res["lp"] = pol.token_logprobs(ids, targets, micro_batch_size=B // 2)
                hook.remove()
                res["norm_inputs"] = seen
                pos, mask = score_positions()
                # micro-batches of 3 rows and 1 row, cut after their last scored position:
                # [3, 8] and [1, 7] (at PP=2 the stages exchange these shapes)
                res["lp_at"] = pol.token_logprobs(ids, targets, positions=pos, mask=mask,
                                                  micro_batch_size=3)
                # a budget of 14 padded tokens: rows of length 8, 6, 1, 7 (up to their last
                # scored position) packed longest first into [row 0] [rows 3, 1] [row 2]:
                # shapes [1, 8], [2, 7], [1, 1], not in row order
                res["lp_tok"] = pol.token_logprobs(ids, targets, positions=pos, mask=mask,
                                                   micro_batch_size=3, micro_batch_tokens=14)
                ref = hf_state_dict(hf)
                back = pol.hf_state_dict()
                res["same"] = back.keys() == ref.keys() and all(
                    torch.equal(back[k], ref[k]) for k in ref)
                # the trainer's weight pull: the full weights on global rank 0 only
                first = pol.hf_state_dict(everywhere=False)
                if rank != 0:
                    assert first is None, f"rank {rank} got weights from everywhere=False"
                else:
                    res["same_first"] = first.keys() == ref.keys() and all(
                        torch.equal(first[k], ref[k]) for k in ref)
                # the trainer's weight stream: one unit per call (here in reverse order)
                streamed = {}
                for unit in reversed(hf_units(pol.arch)):
                    got = pol.hf_state_of_units([unit])
                    assert (got is None) == (rank != 0), f"rank {rank}: {unit} -> {got is None}"
                    streamed.update(got or {})
                if rank == 0:
                    res["same_units"] = streamed.keys() == ref.keys() and all(
                        torch.equal(streamed[k], ref[k]) for k in ref)
                res["before"] = ref
            opt = pol.build_optimizer(lr=0.5, optimizer=name)
            dp, dp_rank = pol.par.dp, pol.par.dp_rank
            mbs = step_microbatches(pol.arch.vocab_size, dp_rank * B // dp,
                                    (dp_rank + 1) * B // dp, micro_rows)
            counts, hooks = _count_calls(pol)
            pol.train_step(opt, mbs, sgd_loss)
            for h in hooks:
                h.remove()
            res.setdefault("train_calls", counts)   # the first step's (rank 0: first stage)
            # the optimizer reads main_grad and leaves it alone: these are the step's gradients
            grads = {k: p.main_grad.detach().clone()
                     for k, p in pol.module.named_parameters()}
            res["grads"][name] = _gather_hf(pol, grads)
            res["after"][name] = pol.hf_state_dict()
            res["padding"][name] = _padding_rows(pol)
            ps.destroy_model_parallel()
        results[case] = res
    if rank == 0:
        torch.save(results, out_path)


def _adam_state_numel(opt) -> int:
    """Elements of the Adam moments (exp_avg, exp_avg_sq) this rank's optimizer holds."""
    from hacpo.models.megatron.policy import chained

    return sum(t.numel() for o in chained(opt)
               for st in o.optimizer.state.values() for k, t in st.items()
               if k in ("exp_avg", "exp_avg_sq"))


def _copy(sd: dict) -> dict:
    """A copy of a state dict (``hf_state_dict`` may hand out the parameters themselves)."""
    return {k: v.detach().clone() for k, v in sd.items()}


def _through_file(obj):
    """``obj`` after a torch.save / torch.load round trip (a checkpoint shard: a copy)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _policy_dtype(tp, dtype):
    """:func:`_policy` for a tied Qwen2 at TP=tp, PP=1 with weights of ``dtype``."""
    from hacpo.models.megatron import MegatronPolicy, init_parallel

    par = init_parallel(tp, 1, None)
    hf = case_model(("qwen2", True)).to(dtype)
    return MegatronPolicy.from_hf(hf, par, params_dtype=dtype)


def distributed_optimizer_worker(rank, world, tp, out_path, dtype=torch.float32):
    """At TP=tp, DP=world/tp, weights of ``dtype``, Adam (lr 0.05), micro-batches of 1 row:
    two ``train_step`` with
    megatron's plain optimizer ("plain"), then with its distributed optimizer ("dist"), whose
    state after the first step (``optimizer_state``, through a file) is loaded into a fresh
    policy + distributed optimizer given the first step's weights, which takes the second step
    again ("resumed"; the plain optimizer's state likewise: "resumed_plain"), each given the
    step-1 weights in ``dtype`` (as a checkpoint's HF copy holds them). Rank 0 saves {"before":
    weights, "plain" / "dist": [weights after step 1, after step 2], "resumed",
    "resumed_plain": weights, "numel": {kind: [(tp_rank, dp_rank, Adam-state elements)
    of every rank]}, "errors": [the ValueErrors of loading a plain state, and a dist state with
    a cut slice, into the fresh distributed optimizer]}."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron import hf_to_megatron, load_megatron_state

    res = {"numel": {}}
    saved = {}
    for kind in ("plain", "dist"):
        pol = _policy_dtype(tp, dtype)
        opt = pol.build_optimizer(lr=0.05, optimizer="adam",
                                  use_distributed_optimizer=kind == "dist")
        dp, r = pol.par.dp, pol.par.dp_rank
        mbs = step_microbatches(pol.arch.vocab_size, r * B // dp, (r + 1) * B // dp, 1)
        res["before"] = _copy(pol.hf_state_dict())
        res[kind] = []
        for step in range(2):
            pol.train_step(opt, mbs, sgd_loss)
            res[kind].append(_copy(pol.hf_state_dict()))
            if step == 0:
                saved[kind] = _through_file(pol.optimizer_state(opt))
        everyone = [None] * world
        dist.all_gather_object(everyone, (pol.par.tp_rank, r, _adam_state_numel(opt)))
        res["numel"][kind] = everyone
        ps.destroy_model_parallel()

    def resumed_policy():
        """A fresh policy with the step-1 weights as a checkpoint's HF copy holds them: in the
        policy's dtype (megatron's fp32 norm weights too; the optimizer state restores them)."""
        pol = _policy_dtype(tp, dtype)
        p = pol.par
        state = hf_to_megatron({k: v.to(dtype) for k, v in res["dist"][0].items()}, pol.arch,
                               tp=p.tp, tp_rank=p.tp_rank, pp=p.pp, pp_rank=p.pp_rank)
        with torch.no_grad():
            load_megatron_state(pol.module, state)
        return pol, p

    pol, p = resumed_policy()                          # the plain optimizer, resumed
    opt = pol.build_optimizer(lr=0.05, optimizer="adam")
    pol.load_optimizer_state(opt, saved["plain"])
    mbs = step_microbatches(pol.arch.vocab_size, p.dp_rank * B // p.dp,
                            (p.dp_rank + 1) * B // p.dp, 1)
    pol.train_step(opt, mbs, sgd_loss)
    res["resumed_plain"] = _copy(pol.hf_state_dict())
    ps.destroy_model_parallel()
    pol, p = resumed_policy()
    opt = pol.build_optimizer(lr=0.05, optimizer="adam", use_distributed_optimizer=True)
    res["errors"] = []
    cut = _through_file(saved["dist"])
    first = cut["distributed"][0]["main_params"][0]
    first[0] = first[0][:-1]
    for bad in (saved["plain"], cut):
        try:
            pol.load_optimizer_state(opt, bad)
            res["errors"].append(None)
        except ValueError as e:
            res["errors"].append(str(e))
    pol.load_optimizer_state(opt, saved["dist"])
    mbs = step_microbatches(pol.arch.vocab_size, p.dp_rank * B // p.dp,
                            (p.dp_rank + 1) * B // p.dp, 1)
    pol.train_step(opt, mbs, sgd_loss)
    res["resumed"] = pol.hf_state_dict()
    ps.destroy_model_parallel()
    if rank == 0:
        torch.save(res, out_path)


def reshard_worker(rank, world, tp, pp, in_path, out_path, distributed=False,
                   dtype=torch.float32):
    """Adam (lr 0.05) on a tied Llama with weights of ``dtype`` at TP=tp, PP=pp (DP = the
    rest), megatron's distributed optimizer if ``distributed``, micro-batches of 1 row (no qkv
    biases: the key bias's true gradient is 0, and Adam normalizes its rounding noise, which
    differs between layouts, to updates of up to lr).
    Without ``in_path``: two ``train_step``; rank 0 saves {"w1", "w2": weights after each
    step, "shards": every rank's ((pp_rank, tp_rank, dp_rank), ``optimizer_state`` after
    step 1, through a file)}. With ``in_path`` ({"w1", "step", "hf": ``moments_to_hf`` of
    another layout's step-1 shards, "scalers": the loss scalers' states}): load w1 (in
    ``dtype``, as a checkpoint's HF copy holds it), set the optimizer from the moments moved to
    this layout (``moments_from_hf`` + ``load_named_moments``), take step 2; rank 0 saves
    {"w2", "set": the parameters set}. Either way rank 0 also saves "scalers" (the loss
    scalers' states before step 2) and, for fp16 / bf16 weights at TP=PP=1, "main2": the
    full-precision weights after step 2 by megatron name (the DP ranks' slices joined)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron import (MegatronPolicy, hf_to_megatron, init_parallel,
                                       load_megatron_state)
    from hacpo.models.megatron.convert import moments_from_hf
    from hacpo.models.megatron.policy import chained, join_slices, named_moments

    par = init_parallel(tp, pp, None)
    pol = MegatronPolicy.from_hf(case_model(("llama", True)).to(dtype), par, params_dtype=dtype)
    p = pol.par
    # fp16: megatron's dynamic loss scaler from 2^10 (its default 2^32 overflows fp16 in the
    # first steps, which train_step refuses); the other dtypes have no scaler
    opt = pol.build_optimizer(lr=0.05, optimizer="adam", use_distributed_optimizer=distributed,
                              initial_loss_scale=2.0 ** 10)
    mbs = step_microbatches(pol.arch.vocab_size, p.dp_rank * B // p.dp,
                            (p.dp_rank + 1) * B // p.dp, 1)
    res = {}
    if in_path is None:
        pol.train_step(opt, mbs, sgd_loss)
        res["w1"] = _copy(pol.hf_state_dict())
        shard = ((p.pp_rank, p.tp_rank, p.dp_rank), _through_file(pol.optimizer_state(opt)))
        every = [None] * world
        dist.all_gather_object(every, shard)
        res["shards"] = every
    else:
        got = torch.load(in_path)
        w1 = {k: v.to(dtype) for k, v in got["w1"].items()}   # as a checkpoint's HF copy: the
        with torch.no_grad():                                  # norms' fp32 weights rounded too
            load_megatron_state(pol.module, hf_to_megatron(
                w1, pol.arch, tp=p.tp, tp_rank=p.tp_rank, pp=p.pp, pp_rank=p.pp_rank))
        res["set"] = pol.load_named_moments(opt, moments_from_hf(
            got["step"], got["hf"], pol.arch, tp=p.tp, tp_rank=p.tp_rank, pp=p.pp,
            pp_rank=p.pp_rank), grad_scalers=got.get("scalers"))
    res["scalers"] = [o.grad_scaler.state_dict() if getattr(o, "grad_scaler", None) else None
                      for o in chained(opt)]
    pol.train_step(opt, mbs, sgd_loss)
    res["w2"] = _copy(pol.hf_state_dict())
    if dtype != torch.float32 and tp == pp == 1:
        every = [None] * world
        dist.all_gather_object(every, _through_file(named_moments(pol.optimizer_state(opt))))
        whole = join_slices(every) if distributed else every[0]
        res["main2"] = {name: st["main"] for name, st in whole.items()}
    ps.destroy_model_parallel()
    if rank == 0:
        torch.save(res, out_path)


# -- an optimizer that keeps Adam's step per parameter group (TE's / apex's FusedAdam) ---------
class GroupStepAdam(torch.optim.Optimizer):
    """A stand-in for TE's / apex's ``FusedAdam`` as megatron-core builds it when either is
    installed (``Adam(params, lr, weight_decay, betas, eps, adam_w_mode)``): the same AdamW
    update as torch's, but the step count is ``param_group["step"]`` (an int, created by the
    first step) and a parameter's state holds only ``exp_avg`` / ``exp_avg_sq``."""

    def __init__(self, params, lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, bias_correction=True):
        assert adam_w_mode and bias_correction
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            t, (b1, b2) = g["step"], g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                assert set(st) == {"exp_avg", "exp_avg_sq"}, sorted(st)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(g["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-g["lr"] / (1 - b1 ** t))


def group_step_adam_worker(rank, world, out_path):
    """Adam (lr 0.05) on a tied Llama at TP=PP=DP=1, two ``train_step``: with torch's AdamW
    ("torch") and with :class:`GroupStepAdam` in megatron-core's place for TE's / apex's
    FusedAdam ("group"), each saving its optimizer shard after step 1 (through a file); then,
    from the step-1 weights, step 2 with each shard's state moved by name
    (``named_moments`` -> ``moments_to_hf`` -> ``moments_from_hf`` -> ``load_named_moments``)
    into the other kind of optimizer ("group->torch", "torch->group"). Rank 0 saves {kind:
    weights after step 2, "group_state": the group optimizer's per-group steps and a
    parameter's state keys after loading the moved state}; "w1/torch", "w1/group": the
    weights after step 1."""
    from unittest import mock

    import megatron.core.optimizer as mco
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron import (MegatronPolicy, hf_to_megatron, init_parallel,
                                       load_megatron_state)
    from hacpo.models.megatron.convert import moments_from_hf, moments_to_hf
    from hacpo.models.megatron.policy import chained, named_moments

    def fused():            # megatron-core's choice when TE or apex is importable
        return mock.patch.multiple(mco, Adam=GroupStepAdam, USING_PYTORCH_OPTIMIZER=False)

    def policy():
        return MegatronPolicy.from_hf(case_model(("llama", True)), init_parallel(1, 1, None))

    res, shards = {}, {}
    for kind in ("torch", "group"):
        pol = policy()
        with fused() if kind == "group" else contextlib.nullcontext():
            opt = pol.build_optimizer(lr=0.05, optimizer="adam")
        assert isinstance(chained(opt)[0].optimizer, GroupStepAdam) == (kind == "group")
        mbs = step_microbatches(pol.arch.vocab_size, 0, B, 1)
        pol.train_step(opt, mbs, sgd_loss)
        res[f"w1/{kind}"] = _copy(pol.hf_state_dict())
        shards[kind] = _through_file(pol.optimizer_state(opt))
        pol.train_step(opt, mbs, sgd_loss)
        res[kind] = _copy(pol.hf_state_dict())
        ps.destroy_model_parallel()
    for src, dst in (("group", "torch"), ("torch", "group")):
        pol = policy()
        with torch.no_grad():
            load_megatron_state(pol.module, hf_to_megatron(res[f"w1/{src}"], pol.arch))
        with fused() if dst == "group" else contextlib.nullcontext():
            opt = pol.build_optimizer(lr=0.05, optimizer="adam")
        step, hf = moments_to_hf([[named_moments(shards[src])]], pol.arch)
        pol.load_named_moments(opt, moments_from_hf(step, hf, pol.arch))
        inner = chained(opt)[0].optimizer
        if dst == "group":
            res["group_state"] = ([g.get("step") for g in inner.param_groups],
                                  sorted(next(iter(inner.state.values()))))
        pol.train_step(opt, step_microbatches(pol.arch.vocab_size, 0, B, 1), sgd_loss)
        res[f"{src}->{dst}"] = _copy(pol.hf_state_dict())
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save(res, out_path)
