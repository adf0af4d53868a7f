"""Batched sampling with a KV cache: ``generate(policy, prompts, num_samples=G, ...) -> Rollout``.

All ``B * G`` sequences decode together. Prompts are left-padded and prefilled once per prompt
(``B`` rows); the cache is then repeated ``G`` times. Each row's positions count only its real
tokens, so a sample does not depend on how much padding its prompt got. Rows that produced
EOS keep decoding padding (ignored, and so are their logits: non-finite ones there are no
error) until every row is done or ``max_new_tokens`` is reached. The loop reads the device
once per new token (no torch.multinomial: its validity checks are two more reads).

Sample order is prompt-major: sample ``i`` answers prompt ``i // G``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hacpo.models.policy import Policy


@dataclass
class Rollout:
    """Responses of one policy to a batch of prompts.

    Attributes (``N = len(prompt_ids) * num_samples`` samples, prompt-major):
        policy_name: name of the policy that generated them.
        prompt_ids: the B prompts as given.
        prompt_index: [N] index into ``prompt_ids`` for each sample.
        response_ids: [N] response ids; EOS included as the last id iff it was produced.
        sampler_logprobs: [N] per-token log-probs under the distribution actually sampled
            from (after temperature and top-p renormalization; the plain softmax for greedy).
            Informational only: the trainer recomputes ``lp_old`` with a forward pass.
        finished_eos: [N] the response ended with EOS.
        truncated: [N] it hit ``max_new_tokens`` without EOS.
    """

    policy_name: str
    prompt_ids: list[list[int]]
    prompt_index: list[int]
    response_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    finished_eos: list[bool]
    truncated: list[bool]

    @property
    def num_samples(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lengths)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all samples (each prompt counted once per sample)."""
        return sum(len(self.prompt_ids[i]) for i in self.prompt_index)

    def sample_prompts(self) -> list[list[int]]:
        """[N] prompt ids of each sample (for ``Policy.response_logprobs``)."""
        return [self.prompt_ids[i] for i in self.prompt_index]


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (tokens [N] long, log-probs [N] float32 under the sampled distribution).

    ``temperature == 0`` is greedy. ``top_p < 1`` keeps the smallest set of most likely tokens
    whose mass reaches ``top_p`` (the most likely token is always kept). A row with a NaN or
    +inf logit, or with every logit -inf, has no distribution to sample: a ValueError naming
    the rows (never a silent token, nor torch's multinomial error).
    """
    tokens, lp, bad = _sample(logits, temperature=temperature, top_p=top_p, generator=generator)
    if bool(bad.any()):
        raise ValueError(_bad_rows_message(bad))
    return tokens, lp


def _bad_rows_message(bad: torch.Tensor) -> str:
    """bad [N] bool (some True) -> the error text of rows without a distribution."""
    rows = bad.nonzero().flatten().tolist()
    return (f"logits of {len(rows)} row(s) (first: {rows[:8]}) are NaN, +inf or all -inf: no "
            f"distribution to sample from (non-finite model outputs)")


def _sample(logits: torch.Tensor, *, temperature: float, top_p: float,
            generator: torch.Generator | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_next` without any host sync: logits [N, V] -> (tokens [N] long,
    log-probs [N] float32, bad [N] bool).

    ``bad`` marks the rows with a NaN or +inf logit or every logit -inf. Nothing here fails on
    them (there is no torch.multinomial to raise), but their tokens (some id in [0, V)) and
    log-probs mean nothing: the caller must check ``bad``. Rows are independent, so the other
    rows get exactly sample_next's tokens and log-probs (the same draws of ``generator`` as
    ``torch.multinomial``).
    """
    logits = logits.float()
    top = logits.amax(-1, keepdim=True)      # [N, 1]: NaN if any logit is (one reduction)
    bad = ~torch.isfinite(top.squeeze(-1))   # [N]
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1), bad
    # shifted first, so that a tiny temperature cannot overflow the largest logit to inf
    probs = torch.softmax((logits - top) / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    tokens = _draw(probs, generator)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log(), bad


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] (rows sum to 1) -> one token per row [N] long, drawn with P = probs.

    The exponential race: argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d. picks v with probability
    p_v. ``torch.multinomial(probs, 1)`` computes exactly this (same draws of ``generator``,
    same tokens) but first validates ``probs`` with two device->host reads (an error for NaN);
    here a NaN row just gets some id in [0, V). A zero-probability token is never picked
    (even if a draw is 0).
    """
    race = probs / torch.empty_like(probs).exponential_(1, generator=generator)
    return race.masked_fill_(probs == 0, -1.0).argmax(-1)


class _DecoderStepper:
    """Incremental decoding for :class:`hacpo.models.decoder.Decoder` (its own KV cache)."""

    def __init__(self, policy: Policy, total_len: int):
        self.model, self.total_len = policy.model, total_len
        self.weight = policy.output_weight

    def prefill(self, ids, mask, pos):
        self.cache = self.model.new_cache(ids.shape[0], self.total_len)
        h = self.model.hidden(ids, mask, pos, self.cache)
        return F.linear(h[:, -1], self.weight)

    def repeat(self, index):    # index = arange(B).repeat_interleave(G) (generate's)
        self.cache.repeat_interleave(int(index.numel() // self.cache.key_mask.shape[0]))

    def step(self, tokens, pos):
        ones = torch.ones_like(tokens, dtype=torch.bool)
        # positions < prompt + max_new_tokens <= max_len (check_generate_args): no read
        h = self.model.hidden(tokens[:, None], ones[:, None], pos[:, None], self.cache,
                              check_positions=False)
        return F.linear(h[:, -1], self.weight)


class _HFStepper:
    """Incremental decoding for transformers causal LMs (``past_key_values``)."""

    def __init__(self, policy: Policy, total_len: int):
        self.model, self.total_len = policy.model, total_len

    def prefill(self, ids, mask, pos):
        from transformers import DynamicCache

        self.mask = torch.ones(ids.shape[0], self.total_len, dtype=torch.long,
                               device=ids.device)
        self.mask[:, :ids.shape[1]] = mask.long()
        self.length = ids.shape[1]
        out = self.model(input_ids=ids, attention_mask=self.mask[:, :self.length],
                         position_ids=pos, past_key_values=DynamicCache(), use_cache=True,
                         logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[:, -1]

    def repeat(self, index):
        repeats = int(index.numel() // self.mask.shape[0])
        self.cache.batch_repeat_interleave(repeats)
        self.mask = self.mask.repeat_interleave(repeats, 0)

    def step(self, tokens, pos):
        self.length += 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask[:, :self.length],
                         position_ids=pos[:, None], past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]


def check_generate_args(policy: Policy, prompt_ids: Sequence[Sequence[int]], *,
                        num_samples: int, max_new_tokens: int, temperature: float,
                        top_p: float) -> list[list[int]]:
    """Validate a sampling request (every rollout engine's): returns the prompts as int lists.
    A bad request is a ValueError naming what is wrong."""
    for name, v, low in (("num_samples", num_samples, 1), ("max_new_tokens", max_new_tokens, 0)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, (bool, str, bytes)) or not _is_real(v):
            raise ValueError(f"{name} must be a real number, got {v!r}")
    if not (0 <= temperature < math.inf and 0 < top_p <= 1):   # NaN fails both
        raise ValueError(f"temperature={temperature} must be finite and >= 0, top_p={top_p} "
                         f"in (0, 1]")
    prompts = [[_token_id(t) for t in p] for p in prompt_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    P = max(len(p) for p in prompts)
    if P + max_new_tokens > policy.max_len:
        raise ValueError(f"policy {policy.name!r}: prompt of {P} + {max_new_tokens} new tokens "
                         f"exceeds max_len={policy.max_len}")
    V = policy.tokenizer.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < V]
    if bad:
        raise ValueError(f"policy {policy.name!r}: prompt id {bad[0]} is outside the "
                         f"vocabulary of {V}")
    return prompts


def _is_real(v) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _token_id(t) -> int:
    """A prompt token id as an int; a non-integral value (1.5, "a", True) is a ValueError."""
    if isinstance(t, torch.Tensor) and t.numel() == 1:
        t = t.item()
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise ValueError(f"prompt ids must be integers, got {t!r}")
    return int(t)


def empty_rollout(policy_name: str, prompts: list[list[int]], num_samples: int) -> Rollout:
    """The Rollout of max_new_tokens=0: every response empty and truncated."""
    N = len(prompts) * num_samples
    return Rollout(policy_name, prompts, [i for i in range(len(prompts))
                                          for _ in range(num_samples)],
                   [[] for _ in range(N)], [[] for _ in range(N)], [False] * N, [True] * N)


@torch.inference_mode()
def generate(policy: Policy, prompt_ids: Sequence[Sequence[int]], *, num_samples: int,
             max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             generator: torch.Generator | None = None) -> Rollout:
    """Sample ``num_samples`` responses per prompt, all ``B * num_samples`` rows batched.

    Args:
        policy: the policy to sample from (put in eval mode by the caller if it has dropout).
        prompt_ids: B non-empty prompts (e.g. ``policy.tokenizer.prompt_ids(question)``).
        num_samples: G responses per prompt.
        max_new_tokens: response length cap (EOS counts as a token).
        temperature: 0 = greedy; otherwise logits are divided by it.
        top_p: nucleus sampling mass (1 = off).
        generator: a ``torch.Generator`` on the model's device, for reproducible draws.

    Returns:
        a :class:`Rollout` with ``B * num_samples`` samples, prompt-major.
    """
    prompts = check_generate_args(policy, prompt_ids, num_samples=num_samples,
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_p=top_p)
    if max_new_tokens == 0:
        return empty_rollout(policy.name, prompts, num_samples)
    tok = policy.tokenizer
    B, G = len(prompts), num_samples
    N = B * G
    P = max(len(p) for p in prompts)
    dev = policy.output_weight.device
    prompt_index = [i for i in range(B) for _ in range(G)]

    ids = torch.full((B, P), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.bool)
    for b, p in enumerate(prompts):  # left padding
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):] = True
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)

    stepper = (_DecoderStepper if policy.kind == "decoder" else _HFStepper)(
        policy, P + max_new_tokens)
    V = tok.vocab_size
    logits = stepper.prefill(ids, mask, pos)[:, :V]
    index = torch.arange(B, device=dev).repeat_interleave(G)
    if G > 1:
        stepper.repeat(index)
        logits = logits.index_select(0, index)
    next_pos = mask.sum(-1).index_select(0, index)  # [N] position of the first new token

    out = torch.full((N, max_new_tokens), tok.pad_id, dtype=torch.long, device=dev)
    out_lp = torch.zeros(N, max_new_tokens, dtype=torch.float32, device=dev)
    finished = torch.zeros(N, dtype=torch.bool, device=dev)
    steps = 0
    for t in range(max_new_tokens):
        tokens, lp, bad = _sample(logits, temperature=temperature, top_p=top_p,
                                  generator=generator)
        bad &= ~finished  # a finished row's logits are not used: its tokens become padding
        tokens = tokens.masked_fill(finished, tok.pad_id)
        out[:, t], out_lp[:, t] = tokens, lp
        steps = t + 1
        finished |= tokens == tok.eos_id
        # The one device->host read of this token: an unusable row, and whether all are done.
        any_bad, all_finished = torch.stack([bad.any(), finished.all()]).tolist()
        if any_bad:
            raise ValueError(f"policy {policy.name!r}, new token {t}: {_bad_rows_message(bad)}")
        if t + 1 == max_new_tokens or all_finished:
            break
        logits = stepper.step(tokens, next_pos + t)[:, :V]

    # Per row: keep tokens up to and including the first EOS.
    out, out_lp = out[:, :steps].cpu(), out_lp[:, :steps].cpu()
    is_eos = out == tok.eos_id
    has_eos = is_eos.any(-1)
    lengths = torch.where(has_eos, is_eos.int().argmax(-1) + 1, steps)
    out_l, lp_l, len_l = out.tolist(), out_lp.tolist(), lengths.tolist()
    return Rollout(
        policy_name=policy.name, prompt_ids=prompts, prompt_index=prompt_index,
        response_ids=[r[:n] for r, n in zip(out_l, len_l)],
        sampler_logprobs=[r[:n] for r, n in zip(lp_l, len_l)],
        finished_eos=has_eos.tolist(), truncated=(~has_eos).tolist())
