"""A policy = a causal LM + its tokenizer + a name, with teacher-forced response log-probs.

The trainer needs exactly two things from a policy besides sampling
(:func:`hacpo.models.generation.generate`):

- ``response_logprobs(prompt_ids, response_ids)`` -> per-token log-probs of each response
  under the current parameters (differentiable), in this policy's own tokenization;
- ``tokenizer`` to build prompts (``prompt_ids``) and re-tokenize other agents' responses.

Build one with :func:`build_policy` from a :class:`PolicyConfig`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hacpo.models.decoder import Decoder, DecoderConfig, PrefixStates
from hacpo.models.tokenizer import Tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """logits [T, V], targets [T] -> log p(target) [T] float32 (differentiable).

    The single place the gather happens: ``hacpo.kernels.token_logprobs`` (Triton on CUDA, the
    chunked torch path elsewhere; never a [T, V] float32 copy of low-precision logits).
    """
    from hacpo.kernels import token_logprobs as kernel
    return kernel(logits, targets, temperature=temperature, backend="auto")


@dataclass
class PolicyConfig:
    """Everything needed to build one agent's policy.

    kind "decoder": the plain-torch :class:`~hacpo.models.decoder.Decoder` sized by
    ``d_model/n_layers/n_heads/max_len``. kind "hf": a transformers causal LM, loaded from
    ``path`` (a local checkpoint directory) if given, else built with random weights from
    ``arch`` (``"llama" | "qwen2" | "gpt2"``) and ``hf_config`` overrides.
    The embedding size is the tokenizer's ``vocab_size`` (after reduction, if
    ``reduce_vocab``; then :func:`build_policy` needs the ``corpus``).
    ``lm_head``: how teacher-forced log-probs leave the final hidden states of the response
    tokens (:meth:`Policy.response_logprobs`): "logits" (the output projection makes logits
    [T, V], then the log-softmax kernel) or "fused" (``hacpo.kernels.fused_linear_token_
    logprobs``: projection and log-softmax in row chunks, no [T, V] tensor in forward or
    backward, at the price of recomputing the projection in the backward).
    """

    name: str = "agent"
    kind: Literal["decoder", "hf"] = "decoder"
    tokenizer: str = "char"
    reduce_vocab: bool = False
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 512
    arch: str = "llama"
    hf_config: dict = field(default_factory=dict)
    path: str | None = None
    dtype: str = "float32"
    seed: int = 0
    lm_head: str = "logits"


LM_HEADS = ("logits", "fused")


class Policy(nn.Module):
    """A causal LM with its tokenizer.

    Args:
        model: a :class:`Decoder` or a transformers ``*ForCausalLM``.
        tokenizer: the :class:`Tokenizer` whose ids the model reads and writes.
        name: agent name (logs, metrics).
        lm_head: "logits" or "fused" (see :class:`PolicyConfig`).
    """

    # Rows of one call that share a prompt have it forwarded once (policies with prompt
    # states: the plain decoder, HF llama/qwen2/gpt2): the G samples of a prompt, and a
    # learner's self and cross samples of it, in training and old-log-prob scoring. Same
    # values and gradients as one full sequence per row.
    share_prompts: bool = True

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, name: str,
                 lm_head: str = "logits"):
        super().__init__()
        if lm_head not in LM_HEADS:
            raise ValueError(f"policy {name!r}: lm_head must be one of {', '.join(LM_HEADS)}, "
                             f"got {lm_head!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.lm_head = lm_head
        self.kind = "decoder" if isinstance(model, Decoder) else "hf"
        # the model's mode (HF models come in eval mode: dropout off); a new Module is in
        # training mode, which the rollout and evaluation restore after sampling with
        # policy.train(was): that turned on a loaded model's dropout (GPT-2's 0.1) for RL
        self.train(model.training)
        n_emb = self.output_weight.shape[0]
        if n_emb < tokenizer.vocab_size:
            raise ValueError(f"policy {name!r}: model has {n_emb} output ids but tokenizer "
                             f"{tokenizer.name!r} has {tokenizer.vocab_size}")
        if self.kind == "hf":
            self._check_plain_output_layer()

    # configuration keys of transformers models whose logits are more than the projection
    _LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")

    def _check_plain_output_layer(self) -> None:
        """Teacher forcing projects the base model's final hidden states with
        :attr:`output_weight` alone (only the response positions, or fused with the
        log-softmax); the sampler reads the model's own logits. A model whose logits are more
        than that projection (an output-layer bias as in Phi, soft-capping as in Gemma 2,
        scaling as in Cohere or Granite) would be trained on other log-probs than it samples:
        refused, checked on the config and on one two-token forward."""
        model, cfg = self.model, self.model.config
        why = None
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            why = "its output layer has a bias"
        for key in self._LOGIT_TRANSFORMS:     # a scale of 1 changes nothing
            v = getattr(cfg, key, None)
            if why is None and v is not None and (key == "final_logit_softcapping" or v != 1):
                why = f"its config sets {key}={v!r}"
        if why is None:
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    ids = torch.tensor([[0, self.tokenizer.vocab_size - 1]],
                                       device=self.output_weight.device)
                    # the base model and the whole model called alike (the same attention
                    # path: no kernel noise in bf16), so only the output layer can differ.
                    # (Not output_hidden_states: transformers then leaves output-capturing
                    # hooks on the modules, and the policy no longer pickles for Ray.)
                    mask = torch.ones_like(ids)
                    hidden = model.base_model(input_ids=ids, attention_mask=mask,
                                              use_cache=False).last_hidden_state
                    ours = F.linear(hidden, self.output_weight)
                    theirs = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            finally:
                model.train(was_training)
            ours, theirs = ours.float(), theirs.float()[..., :ours.shape[-1]]
            diff = float((ours - theirs).abs().max())
            if not diff <= 1e-4 * (1 + float(theirs.abs().max())):
                why = f"its logits differ from that projection by up to {diff:.3g}"
        if why:
            raise ValueError(f"policy {self.name!r}: {type(model).__name__} is not supported: "
                             f"log-probs are the output weight times the final hidden states, "
                             f"but {why}")

    # -- model access ---------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        """Longest prompt + response the model's positions allow."""
        if self.kind == "decoder":
            return self.model.cfg.max_len
        cfg = self.model.config
        return getattr(cfg, "max_position_embeddings", None) or cfg.n_positions

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H] output projection (tied or not)."""
        if isinstance(self.model, Decoder):
            return self.model.output_weight
        return self.model.get_output_embeddings().weight

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask [B, L] -> final hidden states [B, L, H].

        Positions default to the number of real tokens before each token, so left- and
        right-padded batches give the same result per row.
        """
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if self.kind == "decoder":
            return self.model.hidden(input_ids, attention_mask, position_ids)
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask.long(),
                                    position_ids=position_ids, use_cache=False)
        return out.last_hidden_state

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask [B, L] -> logits [B, L, V] (parameter dtype)."""
        return F.linear(self.forward_hidden(input_ids, attention_mask, position_ids),
                        self.output_weight)

    # -- teacher forcing ------------------------------------------------------------------------
    def response_logprobs(self, prompt_ids: Sequence[Sequence[int]],
                          response_ids: Sequence[Sequence[int]], *,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of each response given its prompt (teacher forcing).

        Args:
            prompt_ids: B lists of prompt ids (non-empty).
            response_ids: B lists of response ids (may be empty; EOS included if present).
            temperature: logits are divided by it (match the sampling temperature).

        Returns:
            token_logp [B, Tmax] float32, differentiable w.r.t. the parameters; 0 at padding.
            mask [B, Tmax] bool, True at real response tokens.

        Rows are right-padded into one batch; the output projection and log-softmax run only
        at the ``sum(len(response))`` response positions. A row's values do not depend on the
        other rows (up to float rounding).
        """
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        B = len(prompt_ids)
        dev = self.output_weight.device
        if B == 0:
            return (torch.zeros(0, 0, device=dev),
                    torch.zeros(0, 0, dtype=torch.bool, device=dev))
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("response_logprobs: every prompt needs at least one token")
        if max(lengths) > self.max_len:
            raise ValueError(f"policy {self.name!r}: prompt+response of {max(lengths)} tokens "
                             f"exceeds max_len={self.max_len}")
        Tmax = max((len(r) for r in response_ids), default=0)
        if self.share_prompts and self.supports_prompt_states and Tmax > 0:
            keys = [tuple(p) for p in prompt_ids]
            if len(set(keys)) < B:       # some rows share a prompt: compute each prompt once
                return self._response_logprobs_shared(keys, response_ids, temperature)
        L = max(lengths)
        ids = torch.full((B, L), self.tokenizer.pad_id, dtype=torch.long)
        attn = torch.zeros(B, L, dtype=torch.bool)
        mask = torch.zeros(B, Tmax, dtype=torch.bool)
        rows, cols, targets = [], [], []
        for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            ids[b, :lengths[b]] = torch.tensor(list(p) + list(r), dtype=torch.long)
            attn[b, :lengths[b]] = True
            mask[b, :len(r)] = True
            rows += [b] * len(r)
            cols += range(len(p) - 1, len(p) - 1 + len(r))  # position predicting each token
            targets += r
        self._check_ids(ids[attn], "prompt or response")
        ids, attn, mask = ids.to(dev), attn.to(dev), mask.to(dev)
        hidden = self.forward_hidden(ids, attn)
        h = hidden[torch.tensor(rows, dtype=torch.long, device=dev),
                   torch.tensor(cols, dtype=torch.long, device=dev)]  # [T, H]
        return self._scatter_logprobs(h, targets, mask, temperature)

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        """Real token ids (a CPU long tensor) inside the tokenizer's vocabulary, else a
        ValueError naming the id (an embedding lookup would fail with an IndexError, a device
        assert on CUDA, or read a padded embedding row)."""
        V = self.tokenizer.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise ValueError(f"policy {self.name!r}: {what} id {bad} is outside the vocabulary "
                             f"of {V} ({self.tokenizer.name!r})")

    def _scatter_logprobs(self, h: torch.Tensor, targets: list[int] | torch.Tensor,
                          mask: torch.Tensor, temperature: float):
        """h [T, H] hidden states predicting the T response tokens (row-major; ``targets``
        [T], a list or a long tensor) -> token_logp [B, Tmax] float32 scattered into ``mask``
        [B, Tmax]."""
        dev = h.device
        tgt = torch.as_tensor(targets, dtype=torch.long).to(dev)
        if self.lm_head == "fused":     # no [T, V] logits; padded embedding rows left out
            from hacpo.kernels import fused_linear_token_logprobs
            lp = fused_linear_token_logprobs(h, self.output_weight, tgt, temperature=temperature,
                                             vocab_size=self.tokenizer.vocab_size)
        else:
            logits = F.linear(h, self.output_weight)  # [T, V]
            if logits.shape[-1] > self.tokenizer.vocab_size:  # padded embedding table
                logits = logits[:, :self.tokenizer.vocab_size]
            lp = token_logprobs(logits, tgt, temperature)
        token_logp = torch.zeros(mask.shape, dtype=torch.float32, device=dev)
        return token_logp.masked_scatter(mask, lp), mask

    def _response_logprobs_shared(self, keys: list[tuple], response_ids, temperature: float):
        """response_logprobs with each distinct prompt forwarded once (prompt states)."""
        uniq: dict[tuple, int] = {}
        prefix_of_row = [uniq.setdefault(k, len(uniq)) for k in keys]
        states = self.encode_prompts(list(uniq))
        return self.continuation_logprobs(states, prefix_of_row, response_ids,
                                          temperature=temperature)

    # -- shared prompts across calls ------------------------------------------------------------
    @property
    def supports_prompt_states(self) -> bool:
        """Whether :meth:`encode_prompts` / :meth:`continuation_logprobs` are available: the
        plain decoder, and HF models of a tested architecture (llama, qwen2, gpt2) with full
        attention in every layer (:func:`hacpo.models.hf_states.prompt_states_unsupported`)."""
        return self._prompt_states_unsupported() is None

    def _prompt_states_unsupported(self) -> str | None:
        if self.kind == "decoder":
            return None
        from hacpo.models.hf_states import prompt_states_unsupported
        return prompt_states_unsupported(self.model)

    def encode_prompts(self, prompt_ids: Sequence[Sequence[int]]) -> PrefixStates:
        """Forward P prompts once -> their :class:`PrefixStates` (keys/values per layer and the
        last token's hidden state), differentiable w.r.t. the parameters; responses are then
        scored on them by :meth:`continuation_logprobs`, in one call or several."""
        why = self._prompt_states_unsupported()
        if why is not None:
            raise NotImplementedError(f"policy {self.name!r} ({self.kind}): no prompt states "
                                      f"for this model: {why}")
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("encode_prompts: needs at least one prompt, and every prompt needs "
                             "at least one token")
        dev = self.output_weight.device
        P = len(prompt_ids)
        Lp = max((len(p) for p in prompt_ids), default=0)
        if Lp > self.max_len:
            raise ValueError(f"policy {self.name!r}: prompt of {Lp} tokens exceeds "
                             f"max_len={self.max_len}")
        p_ids = torch.full((P, Lp), self.tokenizer.pad_id, dtype=torch.long)
        p_mask = torch.zeros(P, Lp, dtype=torch.bool)
        for i, p in enumerate(prompt_ids):
            p_ids[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
            p_mask[i, :len(p)] = True
        self._check_ids(p_ids[p_mask], "prompt")
        if self.kind == "decoder":
            return self.model.encode_prefix(p_ids.to(dev), p_mask.to(dev))
        from hacpo.models.hf_states import encode_prefix
        return encode_prefix(self.model, p_ids.to(dev), p_mask.to(dev))

    def continuation_logprobs(self, states: PrefixStates, prompt_of_row: Sequence[int],
                              response_ids: Sequence[Sequence[int]], *,
                              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of each response given prompt ``prompt_of_row[b]`` of
        ``states`` (from :meth:`encode_prompts`): the same (token_logp [B, Tmax], mask [B, Tmax])
        as :meth:`response_logprobs` on the full sequences, up to float rounding. A prompt +
        response longer than the model's positions is an error."""
        if len(prompt_of_row) != len(response_ids):
            raise ValueError(f"{len(prompt_of_row)} prompt indices but {len(response_ids)} "
                             f"responses")
        dev = self.output_weight.device
        P, B = states.last.shape[0], len(response_ids)
        if B and not all(0 <= int(i) < P for i in prompt_of_row):
            raise ValueError(f"continuation_logprobs: prompt index out of range [0, {P})")
        lens = torch.tensor([len(r) for r in response_ids], dtype=torch.long)
        Tmax = int(lens.max()) if B else 0
        mask = torch.arange(Tmax)[None, :] < lens[:, None]                      # [B, Tmax]
        if Tmax == 0:
            return torch.zeros(B, 0, device=dev), mask.to(dev)
        targets = torch.tensor([t for r in response_ids for t in r], dtype=torch.long)
        r_ids = torch.full((B, Tmax), self.tokenizer.pad_id, dtype=torch.long)
        r_ids[mask] = targets                             # row-major: row b's tokens in order
        self._check_ids(targets, "response")
        pidx_cpu = torch.tensor([int(i) for i in prompt_of_row], dtype=torch.long)
        # flat index into [prompts' last states (P); rows (B*Tmax)] of the state predicting each
        # response token: its prompt's last state for a row's first token, else the row's
        # previous position
        b_of, j_of = mask.nonzero(as_tuple=True)
        src = torch.where(j_of == 0, pidx_cpu[b_of], P + b_of * Tmax + j_of - 1)
        pidx = pidx_cpu.to(dev)
        if self.kind == "decoder":    # checks max_len itself
            hr = self.model.hidden_continued(states, r_ids.to(dev), mask.to(dev), pidx)
        else:
            from hacpo.models.hf_states import hidden_continued
            # positions beyond the model's table (gpt2: an index error, a device assert on
            # CUDA) are refused; the bound Lp + Tmax needs no host sync, the exact one does
            if states.mask.shape[1] + Tmax > self.max_len:
                longest = int((states.lengths.index_select(0, pidx)
                               + mask.sum(-1).to(dev)).max())
                if longest > self.max_len:
                    raise ValueError(f"policy {self.name!r}: prompt+response of {longest} "
                                     f"tokens exceeds max_len={self.max_len}")
            hr = hidden_continued(self.model, states, r_ids.to(dev), mask.to(dev), pidx,
                                  max_positions=self.max_len)
        h = torch.cat([states.last, hr.reshape(B * Tmax, hr.shape[-1])])
        h = h.index_select(0, src.to(dev))
        return self._scatter_logprobs(h, targets, mask.to(dev), temperature)


def build_policy(config: PolicyConfig, *, corpus: Iterable[str] | None = None,
                 tokenizer: Tokenizer | None = None,
                 prompts: Iterable[str] | None = None,
                 kept: Sequence[int] | None = None) -> Policy:
    """Build a :class:`Policy` from its config.

    Args:
        config: the policy config.
        corpus: texts for the reduced vocabulary (required iff ``config.reduce_vocab``).
        prompts: questions the reduced vocabulary covers inside the prompt template too (see
            :class:`~hacpo.models.tokenizer.HFTokenizer`).
        kept: instead of ``corpus``, the reduced vocabulary already made (the original ids
            it keeps: the tokenizer's ``kept_ids()``, which a training checkpoint records).
        tokenizer: an already-built tokenizer to use instead of ``config.tokenizer``.
    """
    if config.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}; one of {sorted(DTYPES)}")
    dtype = DTYPES[config.dtype]
    if tokenizer is None:
        if config.reduce_vocab and corpus is None and kept is None:
            raise ValueError(f"policy {config.name!r}: reduce_vocab=True needs a corpus")
        if kept is not None and not config.reduce_vocab:
            raise ValueError(f"policy {config.name!r}: kept= is a reduced vocabulary, and "
                             f"reduce_vocab is False")
        reduce = config.reduce_vocab and kept is None
        tokenizer = load_tokenizer(config.tokenizer, corpus=corpus if reduce else None,
                                   prompts=prompts if reduce else None, kept=kept)
    if config.kind == "decoder":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = Decoder(DecoderConfig(vocab_size=tokenizer.vocab_size,
                                          d_model=config.d_model, n_layers=config.n_layers,
                                          n_heads=config.n_heads, max_len=config.max_len))
        model = model.to(dtype)
    elif config.kind == "hf":
        from hacpo.models.hf import build_hf_model, load_hf_model

        if config.path is not None:
            model = load_hf_model(config.path, dtype=dtype)
            rows = model.get_input_embeddings().weight.shape[0]
            reduced = config.reduce_vocab or getattr(tokenizer, "reduced", False)
            if reduced and rows != tokenizer.vocab_size:
                # the reduced ids 0..V-1 would index the saved model's rows of other tokens
                raise ValueError(
                    f"policy {config.name!r}: policy.reduce_vocab=True renumbers the tokens of "
                    f"tokenizer {tokenizer.name!r} that the data uses as ids "
                    f"0..{tokenizer.vocab_size - 1}, but the model loaded from policy.path="
                    f"{config.path!r} has an embedding table of {rows} rows, trained for "
                    f"other ids: each reduced id would read another token's embedding. Set "
                    f"policy.reduce_vocab=false to use the model's own vocabulary")
        else:
            model = build_hf_model({"arch": config.arch, **config.hf_config},
                                   vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                                   eos_id=tokenizer.eos_id, dtype=dtype, seed=config.seed)
    else:
        raise ValueError(f"unknown policy kind {config.kind!r}; one of 'decoder', 'hf'")
    return Policy(model, tokenizer, config.name, lm_head=config.lm_head)
