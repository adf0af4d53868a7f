"""Build a megatron-core ``GPTModel`` from a Hugging Face Llama / Qwen2 / Qwen3 config.

    arch = ArchSpec.from_hf(hf_config)                     # pure Python, no megatron import
    par = init_parallel(tp=2, pp=1)                        # megatron parallel_state over gloo/nccl
    model = build_gpt_model(arch, par, transformer_impl="local")

``ArchSpec`` is the architecture in one flat record (layers, hidden, heads, kv heads, head dim,
SwiGLU ffn, RMSNorm eps, rope theta, vocab, tied embeddings, qkv bias (Qwen2), qk-norm (Qwen3)).
The same record drives the weight mapping in :mod:`hacpo.models.megatron.convert`.

Vocabulary padding (Megatron-LM's convention): the GPTModel is built with
``Vp = arch.padded_vocab_size(tp)`` rows, the smallest multiple of
``tp * make_vocab_size_divisible_by`` that is >= V (default multiple 1: the smallest multiple of
tp, so the padding is < tp rows and TP=1 never pads; Megatron-LM pads further, to a multiple of
128 * tp by default, for GPU GEMM efficiency: pass ``make_vocab_size_divisible_by`` to
:meth:`ArchSpec.from_hf` for that). The padded rows (ids V..Vp-1, at the end of the last TP
shard(s)) are zero in the embedding and output layer (:mod:`~hacpo.models.megatron.convert`),
their logits are masked to -inf (:meth:`MegatronPolicy.logprobs_from_logits`, or the fused path's
``vocab_size`` in :meth:`MegatronPolicy.logprobs_at`), so they get zero gradient and stay zero;
HF names and shapes never see them.

Sequence parallelism (``sequence_parallel=True``, tp > 1; megatron's: Korthikanti et al. 2022):
between the tensor-parallel regions (norms, residual adds) each TP rank keeps only S/tp of the
sequence positions, so those activations take 1/tp of the memory; the column-parallel linears
all-gather the sequence and the row-parallel ones reduce-scatter it (instead of one
all-reduce). The weights are the same as without it; S must be a multiple of tp
(:class:`~hacpo.models.megatron.policy.MegatronPolicy` pads each micro-batch). megatron-core's
local spec has no norm for it, so the local spec's norms become :class:`SequenceParallelRMSNorm`.

megatron-core is imported inside the functions that need it, so ``import hacpo.models`` (and
this module) never imports megatron.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)

TransformerImpl = Literal["local", "transformer_engine"]
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def require_megatron() -> None:
    """Raise a clear ImportError if megatron-core is not installed."""
    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        raise ImportError("megatron-core is not installed; install it with "
                          "`pip install megatron-core==0.16.1`")


@dataclass(frozen=True)
class ArchSpec:
    """A decoder-only Llama-family architecture (what both HF and Megatron need to agree on)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    make_vocab_size_divisible_by: int = 1   # Vp is a multiple of this times tp (module doc)

    def __post_init__(self):
        m = self.make_vocab_size_divisible_by
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"make_vocab_size_divisible_by must be an integer >= 1, got {m!r}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    @classmethod
    def from_hf(cls, config: Any, *, make_vocab_size_divisible_by: int = 1) -> "ArchSpec":
        """From a transformers ``PretrainedConfig`` or its ``to_dict()``.
        ``make_vocab_size_divisible_by``: see the module docstring (vocabulary padding)."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported HF model_type {model_type!r}; "
                             f"supported: {SUPPORTED_MODEL_TYPES}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"only SwiGLU (hidden_act='silu') is supported, got {act!r}")
        for key in ("rope_scaling", "rope_parameters"):   # transformers 4 / 5 spelling
            rope = cfg.get(key) or {}
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"{key} {rope!r} is not supported (only plain RoPE)")
        if model_type == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise ValueError("llama with attention_bias/mlp_bias is not supported")
        # Qwen3's attention_bias adds q/k/v *and* o_proj biases (Qwen2's fixed q/k/v biases are
        # supported); the megatron model would have no place for them
        if model_type == "qwen3" and cfg.get("attention_bias"):
            raise ValueError("qwen3 with attention_bias=True (q/k/v/o_proj biases) is not "
                             "supported")
        # Qwen2/Qwen3 sliding-window attention (use_sliding_window; transformers 5 lists it per
        # layer in layer_types): megatron's attention here is full causal attention
        types = cfg.get("layer_types")
        if types is None and cfg.get("use_sliding_window") and \
                cfg.get("sliding_window") is not None:   # a transformers-4 style dict
            # layers from this one on slide; transformers' default when the key is missing
            first = cfg.get("max_window_layers", 28)
            if first is None:
                first = 28
            types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(cfg["num_hidden_layers"])]
        if any(t != "full_attention" for t in types or ()):
            raise ValueError(f"sliding-window attention (use_sliding_window, layer types "
                             f"{sorted(set(types))}) is not supported (only full attention)")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:   # transformers 5 keeps it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            model_type=model_type,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        )

    def padded_vocab_size(self, tp: int) -> int:
        """Vp: rows of the megatron embedding / output layer, the smallest multiple of
        ``tp * make_vocab_size_divisible_by`` >= vocab_size (each TP rank holds Vp/tp rows)."""
        m = tp * self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    def real_vocab_of_rank(self, tp: int, tp_rank: int) -> int:
        """How many of TP rank ``tp_rank``'s Vp/tp vocabulary rows are real token ids (< V);
        the rest, at the end of the shard, are padding."""
        shard = self.padded_vocab_size(tp) // tp
        return max(0, min(shard, self.vocab_size - tp_rank * shard))

    def check_parallel(self, tp: int, pp: int) -> None:
        """Clear errors for a TP/PP split this architecture cannot take."""
        for what, n in (("num_attention_heads", self.num_heads),
                        ("num_key_value_heads", self.num_kv_heads),
                        ("intermediate_size", self.ffn_hidden_size)):
            if n % tp:
                raise ValueError(f"{what}={n} is not divisible by tensor-parallel size tp={tp}")
        # the vocabulary is padded to Vp (module doc); every shard must keep a real token id
        vp = self.padded_vocab_size(tp)
        if self.real_vocab_of_rank(tp, tp - 1) < 1:
            shard = vp // tp
            raise ValueError(
                f"vocab_size={self.vocab_size} padded to {vp} (a multiple of tp*"
                f"make_vocab_size_divisible_by = {tp}*{self.make_vocab_size_divisible_by}) "
                f"gives tensor-parallel shards of {shard} rows: rank {tp - 1} (rows "
                f"{(tp - 1) * shard}..{vp - 1}) would hold only padding; use a smaller tp or "
                f"make_vocab_size_divisible_by")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.num_layers % pp:
            raise ValueError(f"num_hidden_layers={self.num_layers} is not divisible by "
                             f"pipeline-parallel size pp={pp}")

    def layers_of_stage(self, pp: int, pp_rank: int) -> range:
        """Global layer indices held by pipeline stage ``pp_rank`` (equal split)."""
        n = self.num_layers // pp
        return range(pp_rank * n, (pp_rank + 1) * n)


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the TP x PP x DP grid (megatron parallel_state order tp-dp-pp)."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def check_megatron_policy(policy, parallel) -> ArchSpec:
    """A built (HF) policy and its agent's ``parallel`` settings (``tp``, ``pp``,
    ``make_vocab_size_divisible_by``, recompute): the :class:`ArchSpec` its megatron shards
    will have, after the checks that need the real vocabulary (every TP shard keeping a real
    token id) and the layers of a stage. Pure Python (no megatron import): the trainer runs it
    before the warm-up. A ValueError names the agent and its tokenizer."""
    try:
        arch = ArchSpec.from_hf(policy.model.config, make_vocab_size_divisible_by=parallel
                                .make_vocab_size_divisible_by)
        arch.check_parallel(parallel.tp, parallel.pp)
        recompute_fields(**parallel.recompute_kwargs(),
                         layers_per_stage=len(arch.layers_of_stage(parallel.pp, 0)))
    except ValueError as e:
        raise ValueError(f"agent {policy.name!r} (trainer=megatron, tokenizer "
                         f"{policy.tokenizer.name!r}): {e}") from None
    return arch


def check_world(tp: int, pp: int, dp: int | None, world_size: int) -> int:
    """Return dp (inferred if None); raise if tp * pp * dp != world_size."""
    for name, v in (("tp", tp), ("pp", pp)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if dp is None:
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}")
        dp = world_size // (tp * pp)
    if tp * pp * dp != world_size:
        raise ValueError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} does not match the world "
                         f"size {world_size}")
    return dp


def init_parallel(tp: int = 1, pp: int = 1, dp: int | None = None, *, seed: int = 0) -> Parallel:
    """Initialize megatron's parallel_state on the already-initialized default process group
    and seed megatron's model-parallel RNG tracker. Returns this rank's :class:`Parallel`."""
    require_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError("init_parallel needs torch.distributed initialized first "
                           "(dist.init_process_group)")
    dp = check_world(tp, pp, dp, dist.get_world_size())
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Parallel(tp=tp, pp=pp, dp=dp,
                    tp_rank=ps.get_tensor_model_parallel_rank(),
                    pp_rank=ps.get_pipeline_model_parallel_rank(),
                    dp_rank=ps.get_data_parallel_rank(),
                    tp_group=ps.get_tensor_model_parallel_group(),
                    pp_group=ps.get_pipeline_model_parallel_group(),
                    dp_group=ps.get_data_parallel_group())


def resolve_transformer_impl(transformer_impl: str) -> str:
    """"local" (megatron-core's own modules) or "transformer_engine" (must be importable: an
    error otherwise, never a silent fallback). Logs the choice."""
    if transformer_impl not in ("local", "transformer_engine"):
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', "
                         f"got {transformer_impl!r}")
    if transformer_impl == "transformer_engine" and \
            importlib.util.find_spec("transformer_engine") is None:
        raise RuntimeError("transformer_impl='transformer_engine' requested but "
                           "transformer_engine is not importable; install it (CUDA only) or "
                           "use transformer_impl='local'")
    log.info("megatron GPTModel: transformer_impl=%s", transformer_impl)
    return transformer_impl


def check_sequence_parallel(sequence_parallel: bool, tp: int) -> None:
    """Sequence parallelism splits activations over the TP ranks: it needs tp > 1."""
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be true or false, got {sequence_parallel!r}")
    if sequence_parallel and tp < 2:
        raise ValueError(f"sequence_parallel needs tensor parallelism (tp > 1), got tp={tp}")


RECOMPUTE = ("none", "selective", "full")
# megatron's selective recompute modules that apply to these dense layers. Not "layernorm":
# with transformer-engine's spec the norms are fused into the next linear (nothing to
# recompute), and with the local spec megatron-core 0.16.1 cannot run it without TE installed
# (CheckpointWithoutOutput() sets fp8 = (False is not None) and reaches TE's FP8 state).
RECOMPUTE_MODULES = ("core_attn", "mlp")


def recompute_fields(recompute: str = "none", modules: Sequence[str] = ("core_attn",),
                     num_layers: int = 1, *, layers_per_stage: int | None = None) -> dict:
    """Megatron's activation recomputation as ``TransformerConfig`` fields, with clear errors.

    ``"none"``: every activation the backward needs is kept. ``"selective"``: the listed
    parts of each layer (``core_attn``: the attention scores / softmax; ``mlp``: the whole
    MLP) keep only their inputs and run again in the backward. ``"full"``: every ``num_layers``
    consecutive layers keep only their input and run again, whole, in the backward (megatron's
    "uniform" method; ``num_layers`` must divide ``layers_per_stage``, when given). Gradients are
    the same; the backward costs up to one more forward."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    mods = list(modules)
    bad = [m for m in mods if m not in RECOMPUTE_MODULES]
    if bad or not mods or len(set(mods)) != len(mods):
        raise ValueError(f"recompute_modules must be distinct names from "
                         f"{', '.join(RECOMPUTE_MODULES)}, got {','.join(mods) or '(none)'}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"recompute_num_layers must be an integer >= 1, got {num_layers!r}")
    if layers_per_stage is not None and recompute == "full" and layers_per_stage % num_layers:
        # megatron's "uniform" chunks would run past the stage's last layer
        raise ValueError(f"recompute_num_layers={num_layers} does not divide a pipeline "
                         f"stage's {layers_per_stage} layer(s)")
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": mods}
    return {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": num_layers}


def transformer_config(arch: ArchSpec, par: Parallel, *, params_dtype=torch.float32,
                       transformer_impl: str = "local", use_cpu_initialization: bool = True,
                       sequence_parallel: bool = False, recompute: dict | None = None):
    """megatron ``TransformerConfig`` for ``arch``: RMSNorm, SwiGLU, GQA, no biases except the
    Qwen2 qkv bias, qk-norm for Qwen3, no dropout, no fused kernels (they need CUDA/apex).
    At PP > 1 ``variable_seq_lengths``: stages exchange each activation's shape first, so
    micro-batches of one schedule may differ in length (each padded to its own longest row).
    ``sequence_parallel`` (tp > 1): megatron's sequence parallelism (module docstring).
    ``recompute``: :func:`recompute_fields`' keyword arguments (activation recomputation)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_sequence_parallel(sequence_parallel, par.tp)
    recompute_kw = recompute_fields(**(recompute or {}),
                                    layers_per_stage=len(arch.layers_of_stage(par.pp, 0)))

    cfg = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization, transformer_impl=transformer_impl,
        sequence_parallel=sequence_parallel, **recompute_kw,
    )
    # set after construction: __post_init__ rejects it with the default MoE token dispatcher
    # ("allgather"), a check for MoE layers, which these dense models do not have
    cfg.variable_seq_lengths = par.pp > 1
    return cfg


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm for megatron-core's local layer spec under sequence parallelism.

    The local spec's norm (``WrappedTorchNorm``: ``torch.nn.RMSNorm``) refuses
    ``config.sequence_parallel`` (megatron-core 0.16.1 leaves SP to transformer-engine's or
    apex's norms). Normalizing is per token, so each TP rank can normalize its own slice of the
    sequence; only the weight's gradient is then partial (this rank's tokens): the weight is
    marked ``sequence_parallel`` and megatron's ``finalize_model_grads`` sums it over the TP
    group, as it does for TE's norms. Same parameter (``weight``) and forward as the local
    spec's norm, so checkpoints and the HF mapping do not change."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm is an RMSNorm, the config asks for "
                             f"{config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))


def layer_spec(arch: ArchSpec, transformer_impl: str, *, sequence_parallel: bool = False,
               num_layers: int | None = None):
    """megatron-core's GPT layer spec: transformer-engine's, or the local one. With
    ``sequence_parallel`` and the local spec, a ``TransformerBlockSubmodules`` of ``num_layers``
    (this stage's) layers whose norms (input, pre-MLP, final, and Qwen3's q/k norms) are
    :class:`SequenceParallelRMSNorm` (TE's norms take sequence parallelism themselves)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if transformer_impl == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    if not sequence_parallel:
        return spec
    import dataclasses

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    sub = spec.submodules
    attn = sub.self_attention
    if arch.qk_norm:
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(
            attn.submodules, q_layernorm=SequenceParallelRMSNorm,
            k_layernorm=SequenceParallelRMSNorm))
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(
        sub, input_layernorm=SequenceParallelRMSNorm, pre_mlp_layernorm=SequenceParallelRMSNorm,
        self_attention=attn))
    if num_layers is None:
        raise ValueError("layer_spec(sequence_parallel=True) needs this stage's num_layers")
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers,
                                      layer_norm=SequenceParallelRMSNorm)


def build_gpt_model(arch: ArchSpec, par: Parallel, *, transformer_impl: TransformerImpl = "local",
                    params_dtype=torch.float32, max_sequence_length: int | None = None,
                    sequence_parallel: bool = False, recompute: dict | None = None):
    """This rank's ``GPTModel`` shard (its TP slice of its PP stage), in eval mode.

    Call :func:`init_parallel` first. Returns vocab-parallel logits [B, S, Vp/tp] from
    ``model(input_ids, position_ids, attention_mask=None)`` on the last stage, where
    ``Vp = arch.padded_vocab_size(tp)`` (see the module docstring; log-probs that mask the
    padded columns: :meth:`~hacpo.models.megatron.policy.MegatronPolicy.logprobs_at`).
    ``sequence_parallel``: see the module docstring (S must then be a multiple of tp).
    ``recompute``: activation recomputation, :func:`recompute_fields`' keyword arguments
    (``{"recompute": "full", "num_layers": 1}``; None: none).
    """
    require_megatron()
    arch.check_parallel(par.tp, par.pp)
    impl = resolve_transformer_impl(transformer_impl)
    from megatron.core.models.gpt import GPTModel

    cfg = transformer_config(arch, par, params_dtype=params_dtype, transformer_impl=impl,
                             sequence_parallel=sequence_parallel, recompute=recompute)
    spec = layer_spec(arch, impl, sequence_parallel=sequence_parallel,
                      num_layers=len(arch.layers_of_stage(par.pp, par.pp_rank)))
    model = GPTModel(config=cfg, transformer_layer_spec=spec,
                     vocab_size=arch.padded_vocab_size(par.tp),
                     max_sequence_length=max_sequence_length or arch.max_position_embeddings,
                     pre_process=par.first_stage, post_process=par.last_stage,
                     parallel_output=True,
                     share_embeddings_and_output_weights=arch.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=arch.rope_theta)
    return model.eval()
