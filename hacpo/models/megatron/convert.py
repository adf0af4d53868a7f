"""Weight mapping Hugging Face (Llama / Qwen2 / Qwen3) <-> megatron-core GPTModel shards.

Pure tensor code: no megatron import, no communication. One rank's shard is addressed by
``(tp_rank, pp_rank)``; :func:`hf_to_megatron` cuts it out of a full HF state dict and
:func:`megatron_to_hf` reassembles a full HF state dict from all shards ``shards[pp][tp]``.
:func:`iter_hf_weights` yields the same ``(hf_name, tensor)`` pairs one at a time, the shape a
vLLM ``load_weights`` consumes; it converts *unit* by unit (the embedding, one layer, the final
norm + output layer: :func:`unit_to_hf`), so a weight stream can gather and convert a few units
at a time (:func:`hacpo.models.buckets.plan_buckets`, re-exported here;
``MegatronPolicy.hf_state_of_units``).

Megatron layouts (per layer ``i``; ``ng`` kv heads, ``nq`` query heads, head dim ``d``):

- ``self_attention.linear_qkv.weight`` [ng*(nq/ng + 2)*d, H], column-parallel: rows grouped
  by kv head g as ``[q heads of group g (nq/ng * d), k_g (d), v_g (d)]``; rank r holds groups
  ``r*ng/tp ... (r+1)*ng/tp - 1`` (a contiguous row block). The Qwen2 qkv bias is laid out alike.
- ``mlp.linear_fc1.weight`` [2*F/tp, H] per rank: ``[gate rows of rank r; up rows of rank r]``
  (megatron's SwiGLU chunks the fc1 output in two halves *after* the TP split).
- ``self_attention.linear_proj`` / ``mlp.linear_fc2``: row-parallel, split along dim 1.
- ``embedding.word_embeddings`` / ``output_layer``: vocab-parallel, contiguous row blocks of the
  vocabulary padded to ``Vp = arch.padded_vocab_size(tp)`` rows: :func:`hf_to_megatron` appends
  ``Vp - V`` zero rows before sharding, :func:`megatron_to_hf` drops them (HF names and shapes
  are the original ones; see :mod:`hacpo.models.megatron.build` on the padding).
- norms (and Qwen3's per-head q/k norms) are replicated.

Layers are split evenly into PP stages; a stage numbers its layers from 0. The embedding lives
on the first stage, the final norm and the output layer on the last. With tied embeddings and
PP > 1 the last stage holds its own copy of the embedding as ``output_layer.weight`` (megatron
keeps the two in sync); at PP = 1 a tied model has no ``output_layer.weight``.

``transformer_impl="transformer_engine"`` fuses the pre-attention / pre-MLP RMSNorm weights
into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from hacpo.models.buckets import plan_buckets  # noqa: F401  (re-exported)
from hacpo.models.megatron.build import ArchSpec

Tensor = torch.Tensor


def _norm_names(transformer_impl: str) -> tuple[str, str]:
    if transformer_impl == "transformer_engine":
        return ("self_attention.linear_qkv.layer_norm_weight",
                "mlp.linear_fc1.layer_norm_weight")
    if transformer_impl == "local":
        return "input_layernorm.weight", "pre_mlp_layernorm.weight"
    raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', "
                     f"got {transformer_impl!r}")


# -- fused QKV ------------------------------------------------------------------------------------
def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: ArchSpec) -> Tensor:
    """q [nq*d, ...], k/v [ng*d, ...] -> megatron's grouped [ng*(nq/ng+2)*d, ...]."""
    ng, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    qg = q.reshape(ng, (arch.num_heads // ng) * d, *rest)
    return torch.cat([qg, k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], 1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, arch: ArchSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv` (on the full, TP-gathered tensor)."""
    ng, d = arch.num_kv_heads, arch.head_dim
    qd = (arch.num_heads // ng) * d
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, qd + 2 * d, *rest)
    q, k, v = g.split([qd, d, d], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _chunk(t: Tensor, tp: int, rank: int, dim: int = 0) -> Tensor:
    return t.chunk(tp, dim)[rank].clone()


def _vocab_shard(t: Tensor, arch: ArchSpec, tp: int, rank: int) -> Tensor:
    """Rows of the [V, H] embedding / output layer padded with zeros to Vp, then rank's block
    (only the block is materialized)."""
    if t.shape[0] != arch.vocab_size:
        raise ValueError(f"vocabulary weight has {t.shape[0]} rows, the config's vocab_size is "
                         f"{arch.vocab_size}")
    shard = arch.padded_vocab_size(tp) // tp
    lo, n = rank * shard, arch.real_vocab_of_rank(tp, rank)
    out = t.new_zeros((shard, *t.shape[1:]))
    out[:n] = t[lo:lo + n]
    return out


def _unpad_vocab(full: Tensor, arch: ArchSpec, tp: int, name: str) -> Tensor:
    """Gathered [Vp, H] megatron rows -> the HF [V, H] (the padding rows dropped)."""
    vp = arch.padded_vocab_size(tp)
    if full.shape[0] != vp:
        raise ValueError(f"{name}: {full.shape[0]} rows over tp={tp}, expected the padded "
                         f"vocabulary Vp={vp} (vocab_size={arch.vocab_size})")
    return full[:arch.vocab_size]


# -- HF -> Megatron -------------------------------------------------------------------------------
def hf_names(arch: ArchSpec) -> list[str]:
    """The HF weight names of ``arch``, in HF order: what :func:`megatron_to_hf` produces and
    :func:`hf_to_megatron` reads (a tied model has no ``lm_head.weight`` here)."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        h = f"model.layers.{i}."
        a = h + "self_attn."
        names += [h + "input_layernorm.weight", a + "q_proj.weight", a + "k_proj.weight",
                  a + "v_proj.weight"]
        if arch.qkv_bias:
            names += [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        if arch.qk_norm:
            names += [a + "q_norm.weight", a + "k_norm.weight"]
        names += [a + "o_proj.weight", h + "post_attention_layernorm.weight",
                  h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight",
                  h + "mlp.down_proj.weight"]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def check_hf_names(names, arch: ArchSpec) -> None:
    """A ValueError naming the weights a full HF state dict of ``arch`` lacks, and those the
    megatron model has no place for (a feature the conversion does not know would otherwise
    be dropped silently: different numbers, not an error). A tied model may carry its
    ``lm_head.weight``."""
    expected = hf_names(arch)
    have = set(names)
    missing = [n for n in expected if n not in have]
    extra = sorted(have - set(expected) - ({"lm_head.weight"} if arch.tie_word_embeddings
                                           else set()))
    if missing or extra:
        def few(xs):
            return ", ".join(xs[:6]) + (f" (+{len(xs) - 6} more)" if len(xs) > 6 else "")
        raise ValueError(
            f"the HF weights do not fit the megatron {arch.model_type} model of this config"
            + (f"; missing: {few(missing)}" if missing else "")
            + (f"; not mapped to megatron (an unsupported feature?): {few(extra)}"
               if extra else ""))


def hf_to_megatron(hf: Mapping[str, Tensor], arch: ArchSpec, *, tp: int = 1, tp_rank: int = 0,
                   pp: int = 1, pp_rank: int = 0,
                   transformer_impl: str = "local") -> dict[str, Tensor]:
    """Full HF state dict -> the megatron state dict of shard (tp_rank, pp_rank).

    Every weight of ``hf`` must map to megatron and none may be missing
    (:func:`check_hf_names`). ``_extra_state`` entries are not produced (load with
    :func:`load_megatron_state`).
    """
    arch.check_parallel(tp, pp)
    check_hf_names(hf.keys(), arch)
    ln1, ln2 = _norm_names(transformer_impl)
    out: dict[str, Tensor] = {}
    embed = hf["model.embed_tokens.weight"]
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _vocab_shard(embed, arch, tp, tp_rank)
    for local, i in enumerate(arch.layers_of_stage(pp, pp_rank)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        a = h + "self_attn."
        out[m + ln1] = hf[h + "input_layernorm.weight"].clone()
        qkv = fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"],
                       arch)
        out[m + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp, tp_rank)
        if arch.qkv_bias:
            b = fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], arch)
            out[m + "self_attention.linear_qkv.bias"] = _chunk(b, tp, tp_rank)
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = _chunk(hf[a + "o_proj.weight"], tp,
                                                              tp_rank, 1)
        out[m + ln2] = hf[h + "post_attention_layernorm.weight"].clone()
        gate = _chunk(hf[h + "mlp.gate_proj.weight"], tp, tp_rank)
        up = _chunk(hf[h + "mlp.up_proj.weight"], tp, tp_rank)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[m + "mlp.linear_fc2.weight"] = _chunk(hf[h + "mlp.down_proj.weight"], tp, tp_rank, 1)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = _vocab_shard(hf["lm_head.weight"], arch, tp, tp_rank)
        elif pp > 1:   # the last stage's own copy of the tied embedding
            out["output_layer.weight"] = _vocab_shard(embed, arch, tp, tp_rank)
    return out


# -- Megatron -> HF -------------------------------------------------------------------------------
# A *unit* is the piece of the model one conversion step needs whole: ("embed", 0) (stage 0's
# embedding), ("layer", i) (HF layer i, on the stage that holds it) and ("final", 0) (the
# final norm and, untied, the output layer, on the last stage). Units in HF order convert to
# the same pairs as the whole model; a weight stream moves a few units at a time.
Unit = tuple[str, int]


def hf_units(arch: ArchSpec) -> list[Unit]:
    """Every unit of the model, in HF order."""
    return [("embed", 0), *(("layer", i) for i in range(arch.num_layers)), ("final", 0)]


def unit_stage(unit: Unit, arch: ArchSpec, pp: int) -> int:
    """The pipeline stage that holds ``unit``."""
    kind, i = unit
    if kind == "embed":
        return 0
    if kind == "final":
        return pp - 1
    if kind == "layer" and 0 <= i < arch.num_layers:
        return i // (arch.num_layers // pp)
    raise ValueError(f"no unit {unit!r} in a model of {arch.num_layers} layers")


def unit_megatron_names(unit: Unit, names, arch: ArchSpec, pp: int) -> list[str]:
    """The megatron names of ``unit`` among ``names`` (the keys of its stage's shard, in their
    order: every TP rank of the stage lists the same names; megatron's ``_extra_state``
    entries are no weights and are left out)."""
    kind, i = unit
    names = [n for n in names if not n.endswith("_extra_state")]
    if kind == "embed":
        return [n for n in names if n.startswith("embedding.")]
    if kind == "final":    # a tied model's last-stage output layer is a copy: not needed
        keep = ("decoder.final_layernorm.",) + (() if arch.tie_word_embeddings
                                                 else ("output_layer.",))
        return [n for n in names if n.startswith(keep)]
    local = i - arch.layers_of_stage(pp, unit_stage(unit, arch, pp))[0]
    return [n for n in names if n.startswith(f"decoder.layers.{local}.")]


def unit_of_hf_name(name: str) -> Unit:
    """The unit an HF weight name belongs to."""
    if name.startswith("model.embed_tokens."):
        return ("embed", 0)
    if name.startswith("model.layers."):
        return ("layer", int(name.split(".")[2]))
    if name.startswith(("model.norm.", "lm_head.")):
        return ("final", 0)
    raise ValueError(f"{name!r} is not a Llama / Qwen2 / Qwen3 weight name")


def unit_to_hf(unit: Unit, parts: Sequence[Mapping[str, Tensor]], arch: ArchSpec, *, pp: int,
               transformer_impl: str = "local") -> Iterator[tuple[str, Tensor]]:
    """``parts[tp_rank]`` (the unit's megatron tensors of every TP shard of its stage) ->
    (HF name, full tensor) pairs, in HF order. Tensors may share storage with ``parts``
    (always the replicated norms; at tp = 1 all of them): clone what must outlive them."""
    tp = len(parts)
    ln1, ln2 = _norm_names(transformer_impl)
    kind, i = unit

    def cat(name: str, dim: int = 0) -> Tensor:      # tp = 1: the shard itself, no copy
        return parts[0][name] if tp == 1 else torch.cat([parts[r][name] for r in range(tp)],
                                                        dim)

    if kind == "embed":
        yield "model.embed_tokens.weight", _unpad_vocab(cat("embedding.word_embeddings.weight"),
                                                        arch, tp, "embedding.word_embeddings.weight")
    elif kind == "final":
        yield "model.norm.weight", parts[0]["decoder.final_layernorm.weight"]
        if not arch.tie_word_embeddings:
            yield "lm_head.weight", _unpad_vocab(cat("output_layer.weight"), arch, tp,
                                                 "output_layer.weight")
    else:
        local = i - arch.layers_of_stage(pp, unit_stage(unit, arch, pp))[0]
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        a, first = h + "self_attn.", parts[0]
        yield h + "input_layernorm.weight", first[m + ln1]
        q, k, v = split_qkv(cat(m + "self_attention.linear_qkv.weight"), arch)
        yield a + "q_proj.weight", q
        yield a + "k_proj.weight", k
        yield a + "v_proj.weight", v
        if arch.qkv_bias:
            q, k, v = split_qkv(cat(m + "self_attention.linear_qkv.bias"), arch)
            yield a + "q_proj.bias", q
            yield a + "k_proj.bias", k
            yield a + "v_proj.bias", v
        if arch.qk_norm:
            yield a + "q_norm.weight", first[m + "self_attention.q_layernorm.weight"]
            yield a + "k_norm.weight", first[m + "self_attention.k_layernorm.weight"]
        yield a + "o_proj.weight", cat(m + "self_attention.linear_proj.weight", 1)
        yield h + "post_attention_layernorm.weight", first[m + ln2]
        fc1 = [parts[r][m + "mlp.linear_fc1.weight"].chunk(2, 0) for r in range(tp)]
        yield h + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1], 0)
        yield h + "mlp.up_proj.weight", torch.cat([u for _, u in fc1], 0)
        yield h + "mlp.down_proj.weight", cat(m + "mlp.linear_fc2.weight", 1)


def iter_hf_weights(shards: Sequence[Sequence[Mapping[str, Tensor]]], arch: ArchSpec, *,
                    transformer_impl: str = "local") -> Iterator[tuple[str, Tensor]]:
    """``shards[pp_rank][tp_rank]`` (megatron state dicts of every shard) -> (HF name, full
    tensor) pairs. A tied model yields no ``lm_head.weight`` (HF and vLLM tie it themselves)."""
    pp, tp = len(shards), len(shards[0])
    if any(len(s) != tp for s in shards):
        raise ValueError("every pipeline stage needs the same number of TP shards")
    arch.check_parallel(tp, pp)
    for unit in hf_units(arch):
        yield from unit_to_hf(unit, shards[unit_stage(unit, arch, pp)], arch, pp=pp,
                              transformer_impl=transformer_impl)


def megatron_to_hf(shards: Sequence[Sequence[Mapping[str, Tensor]]], arch: ArchSpec, *,
                   transformer_impl: str = "local") -> dict[str, Tensor]:
    """:func:`iter_hf_weights` collected into a dict."""
    return dict(iter_hf_weights(shards, arch, transformer_impl=transformer_impl))


# -- optimizer state across layouts ---------------------------------------------------------------
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN_WEIGHTS = "main"      # a 16-bit model's full-precision weights, moved as a moment


def moments_to_hf(shards: Sequence[Sequence[Mapping[str, Mapping[str, Tensor]]]], arch: ArchSpec,
                  *, transformer_impl: str = "local") -> tuple[float, dict[str, dict[str, Tensor]]]:
    """Adam's per-parameter state of every (pp_rank, tp_rank) shard of one layout
    (``shards[pp_rank][tp_rank]``: ``{megatron name: {"step", "exp_avg", "exp_avg_sq"[,
    "main"]}}``, as :func:`hacpo.models.megatron.policy.named_moments` reads a shard, whole
    parameters) -> (step, {moment: full HF-named tensors}). The moments (and the fp32 main
    weights of fp16 / bf16 weights, "main") have their parameters' shapes and are elementwise,
    so they move between layouts exactly as the weights do (:func:`megatron_to_hf`; padded
    vocabulary rows dropped). Every parameter must have Adam's state (with main weights for
    all or none), all at one step; shards without any state (no update has run yet) give
    (0.0, {})."""
    if not any(shard for row in shards for shard in row):
        return 0.0, {}
    steps, kinds = set(), set()
    for row in shards:
        for shard in row:
            for name, st in shard.items():
                keys = set(st) - {"step", MAIN_WEIGHTS}
                if keys != set(ADAM_MOMENTS) or "step" not in st:
                    raise ValueError(f"optimizer state of {name!r} has {sorted(st)}, not Adam's "
                                     f"step / exp_avg / exp_avg_sq")
                steps.add(float(st["step"]))
                kinds.add(MAIN_WEIGHTS in st)
    if len(steps) != 1:
        raise ValueError(f"the optimizer shards are at different steps {sorted(steps)}")
    if len(kinds) != 1:
        raise ValueError("the optimizer shards hold fp32 main weights for some parameters only")
    hf = {}
    for key in ADAM_MOMENTS + ((MAIN_WEIGHTS,) if kinds.pop() else ()):
        try:
            hf[key] = megatron_to_hf([[{n: st[key] for n, st in shard.items()} for shard in row]
                                      for row in shards], arch,
                                     transformer_impl=transformer_impl)
        except KeyError as e:
            raise ValueError(f"the optimizer shards hold no state for parameter {e}") from None
    return steps.pop(), hf


def moments_from_hf(step: float, hf: Mapping[str, Mapping[str, Tensor]], arch: ArchSpec, *,
                    tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0,
                    transformer_impl: str = "local") -> dict[str, dict[str, Tensor]]:
    """:func:`moments_to_hf`'s result -> shard (tp_rank, pp_rank)'s per-parameter Adam state
    ``{megatron name: {"step", "exp_avg", "exp_avg_sq"[, "main"]}}`` (padded vocabulary rows:
    zeros)."""
    per = {key: hf_to_megatron(hf[key], arch, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank,
                               transformer_impl=transformer_impl) for key in hf}
    return {name: {"step": torch.tensor(step, dtype=torch.float32),
                   **{key: per[key][name] for key in per}}
            for name in per[ADAM_MOMENTS[0]]}


def hf_state_dict(model) -> dict[str, Tensor]:
    """An HF causal LM's state dict in the names :func:`megatron_to_hf` produces (without the
    tied ``lm_head.weight``)."""
    sd = dict(model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd


def load_megatron_state(model: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Load a converted shard into a megatron module: every parameter must be provided and no
    extra name may be left; only megatron's ``_extra_state`` entries may be missing."""
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"converted weights do not match the megatron model: missing {missing}, "
                         f"unexpected {unexpected}")
