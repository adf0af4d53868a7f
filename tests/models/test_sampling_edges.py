"""Edges of the sampler and of generate() that the broader generation tests do not pin down:
the nucleus boundary (mass exactly reached, the token that crosses top_p), a zero-probability
token under a zero exponential draw, the max_len boundary and the prompt order of an empty
rollout. Expected values are computed independently (float64 nucleus by hand, exact
dyadic probabilities), never from the sampler's own output."""
import math

import pytest
import torch

from hacpo.models.decoder import Decoder, DecoderConfig
from hacpo.models.generation import _draw, empty_rollout, generate, sample_next
from hacpo.models.policy import Policy
from hacpo.models.tokenizer import CharTokenizer


def _nucleus(p: list[float], top_p: float) -> int:
    """Size of the smallest set of most likely tokens whose mass reaches ``top_p`` (float64)."""
    total = 0.0
    for k, q in enumerate(sorted(p, reverse=True), start=1):
        total += q
        if total >= top_p:
            return k
    return len(p)


@pytest.mark.parametrize("top_p", [0.25, 0.5, 0.75, 0.5 + 1e-6, 0.25 - 1e-6, 1.0])
def test_top_p_keeps_the_smallest_set_that_reaches_the_mass(top_p):
    """Four equal logits: every probability is exactly 1/4 (and every partial sum exact), so
    a mass of exactly 0.5 is reached by 2 tokens, not 3; a top_p just above 0.5 keeps the
    third token, the one that crosses it. The log-prob is log(1/k) under the renormalized
    nucleus of k tokens, for every row and every draw."""
    k = _nucleus([0.25] * 4, top_p)
    logits = torch.zeros(256, 4)
    tok, lp = sample_next(logits, temperature=1.0, top_p=top_p,
                          generator=torch.Generator().manual_seed(0))
    assert torch.equal(lp, torch.full((256,), math.log(1.0 / k), dtype=torch.float32))
    assert len(set(tok.tolist())) <= k


def test_top_p_boundary_with_unequal_probabilities():
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in float32): top_p = 3/4 is reached by the
    two most likely tokens exactly; 3/4 + 1e-6 needs the third (either of the tied 1/8s)."""
    logits = torch.log(torch.tensor([0.125, 0.5, 0.125, 0.25], dtype=torch.float64)).float()
    p = torch.softmax(logits, -1)
    assert p.tolist() == [0.125, 0.5, 0.125, 0.25]     # the premise: exact dyadic values
    x = logits.repeat(512, 1)
    tok, lp = sample_next(x, temperature=1.0, top_p=0.75,
                          generator=torch.Generator().manual_seed(1))
    assert set(tok.tolist()) <= {1, 3}
    want = {1: math.log(0.5 / 0.75), 3: math.log(0.25 / 0.75)}
    assert lp.tolist() == [pytest.approx(want[t], abs=1e-6) for t in tok.tolist()]
    tok, lp = sample_next(x, temperature=1.0, top_p=0.75 + 1e-6,
                          generator=torch.Generator().manual_seed(1))
    assert {1, 3} <= set(tok.tolist())       # 512 draws: P(missing one) < 1e-60
    assert len(set(tok.tolist()) - {1, 3}) == 1    # exactly one of the tied 1/8s kept
    assert {t: v for t, v in zip(tok.tolist(), lp.tolist())}[1] == pytest.approx(
        math.log(0.5 / 0.875), abs=1e-6)


def test_a_zero_probability_token_is_never_drawn_even_for_a_zero_draw(monkeypatch):
    """_draw's race is p / E; with E = 0 a zero-probability token gives 0/0 = NaN, which
    argmax would pick. Every exponential draw forced to 0: the token must still be one with
    positive probability (the first of them: +inf ties)."""
    monkeypatch.setattr(torch.Tensor, "exponential_",
                        lambda self, *a, **k: self.zero_())
    probs = torch.tensor([[0.0, 0.0, 0.6, 0.4], [0.0, 1.0, 0.0, 0.0], [0.3, 0.0, 0.0, 0.7]])
    assert _draw(probs, None).tolist() == [2, 1, 0]


def _tiny_policy(max_len: int) -> Policy:
    tok = CharTokenizer()
    torch.manual_seed(0)
    return Policy(Decoder(DecoderConfig(vocab_size=tok.vocab_size, d_model=32,
                                        max_len=max_len)), tok, "tiny")


def test_prompt_plus_new_tokens_may_fill_max_len_but_not_exceed_it():
    """P + max_new_tokens == max_len is allowed (greedy runs to the end); one more is the
    request's own error naming both numbers, not the decoder's cache error."""
    pol = _tiny_policy(max_len=8)
    prompts = [[5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match=r"policy 'tiny': prompt of 3 \+ 6 new tokens exceeds "
                                         r"max_len=8"):
        generate(pol, prompts, num_samples=1, max_new_tokens=6, temperature=0)
    ro = generate(pol, prompts, num_samples=1, max_new_tokens=5, temperature=0)
    assert all(len(r) <= 5 for r in ro.response_ids)


@pytest.mark.parametrize("via_generate", [False, True])
def test_empty_rollout_is_prompt_major(via_generate):
    """max_new_tokens=0: sample i answers prompt i // G, like every other rollout."""
    prompts = [[5, 6], [7], [8, 9, 10]]
    if via_generate:
        ro = generate(_tiny_policy(max_len=16), prompts, num_samples=2, max_new_tokens=0)
    else:
        ro = empty_rollout("tiny", prompts, 2)
    assert ro.prompt_index == [0, 0, 1, 1, 2, 2]
    assert ro.sample_prompts() == [[5, 6], [5, 6], [7], [7], [8, 9, 10], [8, 9, 10]]
    assert ro.response_ids == [[]] * 6 and ro.sampler_logprobs == [[]] * 6
    assert ro.truncated == [True] * 6 and ro.finished_eos == [False] * 6
    assert ro.num_prompt_tokens == 12



def test_prompt_ids_must_lie_inside_the_vocabulary():
    """The last id (V - 1) is a valid prompt token; V and -1 are the request's clear error
    naming the id and the vocabulary size (not an embedding IndexError)."""
    pol = _tiny_policy(max_len=16)
    V = pol.tokenizer.vocab_size
    ro = generate(pol, [[5, V - 1]], num_samples=1, max_new_tokens=1, temperature=0)
    assert ro.prompt_ids == [[5, V - 1]]
    for bad in (V, -1):
        with pytest.raises(ValueError, match=rf"policy 'tiny': prompt id {bad} is outside the "
                                             rf"vocabulary of {V}"):
            generate(pol, [[5, bad]], num_samples=1, max_new_tokens=1, temperature=0)


@pytest.mark.parametrize("bad", [True, False, torch.tensor(True)])
def test_a_boolean_prompt_id_is_refused(bad):
    """bool is an int subclass (True == 1): a prompt of flags is a caller's bug, not ids."""
    want = bool(bad)          # a one-element tensor is read as its Python value
    with pytest.raises(ValueError, match=rf"prompt ids must be integers, got {want}$"):
        generate(_tiny_policy(max_len=16), [[5, bad]], num_samples=1, max_new_tokens=1,
                 temperature=0)


def test_decoding_stops_once_every_row_has_produced_eos():
    """Rows that produced EOS only decode padding: once every row has, the loop ends (one
    model call per new token but the last) instead of running on to max_new_tokens."""
    from tests.models.test_generation import ScriptedDecoder

    tok = CharTokenizer()
    d = [tok.encode(str(i))[0] for i in range(10)]

    class Counting(ScriptedDecoder):
        calls = 0

        def hidden(self, *a, **k):
            Counting.calls += 1
            return super().hidden(*a, **k)

    pol = Policy(Counting(tok, {d[i]: d[i + 1] for i in range(9)} | {d[9]: tok.eos_id}), tok,
                 "count")
    ro = generate(pol, [tok.encode("x=9"), tok.encode("y=7")], num_samples=2,
                  max_new_tokens=40, temperature=0)
    assert [tok.decode(r) for r in ro.response_ids] == ["", "", "89", "89"]
    assert ro.finished_eos == [True] * 4
    assert Counting.calls == 3       # the prefill, then after new tokens 0 and 1 (EOS at 2)


class _WideHead(Decoder):
    """An output layer with 8 more rows than the tokenizer has ids (as real checkpoints pad
    theirs): every hidden state is all ones, so the padding rows (weight 1) get the largest
    logits and, inside the vocabulary, token 5 (weight 0.01) does."""

    def hidden(self, input_ids, attention_mask=None, position_ids=None, cache=None,
               check_positions=True):
        super().hidden(input_ids, attention_mask, position_ids, cache)  # advance the cache
        return torch.ones(*input_ids.shape, self.cfg.d_model)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_no_token_outside_the_tokenizers_vocabulary_is_sampled(temperature):
    """Logits beyond the tokenizer's vocabulary (padded output rows) are never sampled, from
    the first new token on (the prefill's logits) as from every later one."""
    tok = CharTokenizer()
    V = tok.vocab_size
    model = _WideHead(DecoderConfig(vocab_size=V + 8, d_model=16, n_layers=1, n_heads=2))
    with torch.no_grad():
        model.output_weight.zero_()
        model.output_weight[V:] = 1.0
        model.output_weight[5] = 0.01
    pol = Policy(model, tok, "wide")
    ro = generate(pol, [[6, 7], [8]], num_samples=3, max_new_tokens=4, temperature=temperature,
                  generator=torch.Generator().manual_seed(0))
    assert all(0 <= t < V for r in ro.response_ids for t in r)
    if temperature == 0:
        assert ro.response_ids == [[5] * 4] * 6
