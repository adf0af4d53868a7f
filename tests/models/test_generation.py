import pytest
import torch

from hacpo.models.decoder import Decoder, DecoderConfig
from hacpo.models.generation import generate, sample_next
from hacpo.models.policy import Policy
from hacpo.models.tokenizer import CharTokenizer

QUESTIONS = ["What is 2+3?", "Tom has 12 apples and eats 5. How many are left?", "7*8=?"]


def _prompts(policy):
    return [policy.tokenizer.prompt_ids(q) for q in QUESTIONS]  # 3 different lengths


def _padded(rows):
    T = max(len(r) for r in rows)
    return torch.tensor([r + [0.0] * (T - len(r)) for r in rows])


def test_cached_sampling_logprobs_equal_full_recompute(policy):
    """KV-cache decoding (left padding, G copies of each prompt) matches teacher forcing."""
    g = torch.Generator().manual_seed(0)
    ro = generate(policy, _prompts(policy), num_samples=2, max_new_tokens=12, temperature=0.8,
                  generator=g)
    assert ro.num_samples == 6 and ro.prompt_index == [0, 0, 1, 1, 2, 2]
    lp, mask = policy.response_logprobs(ro.sample_prompts(), ro.response_ids, temperature=0.8)
    assert mask.sum(-1).tolist() == ro.response_lengths
    # Cached incremental fp32 attention vs one full forward: rounding only.
    torch.testing.assert_close(lp, _padded(ro.sampler_logprobs) * mask, atol=2e-5, rtol=1e-5)


def test_greedy_is_deterministic_and_tiny_top_p_is_greedy(policy):
    prompts = _prompts(policy)
    a = generate(policy, prompts, num_samples=2, max_new_tokens=8, temperature=0)
    b = generate(policy, prompts, num_samples=1, max_new_tokens=8, temperature=0)
    assert a.response_ids[::2] == a.response_ids[1::2] == b.response_ids
    c = generate(policy, prompts, num_samples=2, max_new_tokens=8, temperature=1.0,
                 top_p=1e-6, generator=torch.Generator().manual_seed(5))
    assert c.response_ids == a.response_ids
    assert all(abs(x) < 1e-6 for row in c.sampler_logprobs for x in row)  # p = 1 after top-p


def test_sampling_reproducible_with_generator(policy):
    prompts = _prompts(policy)
    runs = [generate(policy, prompts, num_samples=4, max_new_tokens=6,
                     generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert runs[0].response_ids == runs[1].response_ids
    assert runs[0].response_ids != runs[2].response_ids


def test_sample_next_temperature_and_top_p_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, temperature=1.0, top_p=1.0, generator=g)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    # 20k draws: binomial std <= 0.0036; 0.015 is > 4 std.
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    torch.testing.assert_close(lp, torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[tok])
    tok, lp = sample_next(logits, temperature=1.0, top_p=0.7, generator=g)  # keeps {0, 1}
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp, torch.tensor([0.625, 0.375, 1.0, 1.0]).log()[tok])
    tok, _ = sample_next(logits, temperature=0.25, top_p=1.0, generator=g)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 4
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    torch.testing.assert_close(freq, p / p.sum(), atol=0.015, rtol=0)


class ScriptedDecoder(Decoder):
    """Greedy output is a fixed function of the last input token (cache still exercised)."""

    def __init__(self, tok: CharTokenizer, next_token: dict[int, int]):
        super().__init__(DecoderConfig(vocab_size=tok.vocab_size, d_model=96, n_heads=4))
        table = torch.arange(tok.vocab_size)
        for a, b in next_token.items():
            table[a] = b
        self.register_buffer("table", table)
        with torch.no_grad():
            self.embed.weight.copy_(torch.eye(tok.vocab_size, 96))

    def hidden(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        super().hidden(input_ids, attention_mask, position_ids, cache)  # advance the cache
        return 10 * self.embed.weight[self.table[input_ids]]


def test_eos_stop_and_truncation_flags():
    tok = CharTokenizer()
    digits = [tok.encode(str(d))[0] for d in range(10)]
    script = {digits[d]: digits[d + 1] for d in range(9)} | {digits[9]: tok.eos_id}
    pol = Policy(ScriptedDecoder(tok, script), tok, "scripted")
    prompts = [tok.encode("x=7"), tok.encode("y=1"), tok.encode("z=9")]
    ro = generate(pol, prompts, num_samples=2, max_new_tokens=5, temperature=0)
    texts = [tok.decode(r) for r in ro.response_ids]
    assert texts == ["89", "89", "23456", "23456", "", ""]
    assert ro.response_lengths == [3, 3, 5, 5, 1, 1]
    assert ro.response_ids[4] == [tok.eos_id]
    assert ro.finished_eos == [True, True, False, False, True, True]
    assert ro.truncated == [False, False, True, True, False, False]
    assert ro.num_response_tokens == 18
    assert ro.num_prompt_tokens == 18
    ro0 = generate(pol, prompts, num_samples=1, max_new_tokens=0)
    assert ro0.response_ids == [[], [], []] and all(ro0.truncated)


def test_generate_checks_length_and_arguments(policy):
    prompts = _prompts(policy)
    with pytest.raises(ValueError, match="exceeds max_len"):
        generate(policy, prompts, num_samples=1, max_new_tokens=policy.max_len)
    with pytest.raises(ValueError, match="top_p"):
        generate(policy, prompts, num_samples=1, max_new_tokens=4, top_p=0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(policy, [[]], num_samples=1, max_new_tokens=4)


def test_generation_leaves_no_grad_state(policy):
    ro = generate(policy, _prompts(policy)[:1], num_samples=2, max_new_tokens=3)
    assert torch.is_grad_enabled()
    lp, mask = policy.response_logprobs(ro.sample_prompts(), ro.response_ids)
    assert lp.requires_grad


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(temperature="0.7"), "temperature must be a real number"),
    (dict(top_p=float("nan")), "top_p=nan"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(num_samples=1.5), "num_samples must be an integer"),
    (dict(num_samples=0), "num_samples must be an integer >= 1"),
    (dict(prompts=[[1.7, 2.2]]), "prompt ids must be integers, got 1.7"),
    (dict(prompts=["abc"]), "prompt ids must be integers, got 'a'"),
])
def test_generate_rejects_bad_arguments_clearly(kw, match):
    """NaN/inf temperature used to reach torch.multinomial (or sample uniformly); fractional
    counts failed inside torch; fractional prompt ids were silently truncated."""
    pol = Policy(Decoder(DecoderConfig(vocab_size=CharTokenizer().vocab_size, d_model=32)),
                 CharTokenizer(), "d")
    args = dict(prompts=[[5, 6, 7]], num_samples=2, max_new_tokens=3, temperature=1.0, top_p=1.0)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        generate(pol, args.pop("prompts"), **args)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_non_finite_logits_are_a_clear_error(temperature):
    """Greedy decoding of NaN logits used to return token 0 with a NaN log-prob, silently."""
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(3, 5)
        logits[1, 2] = bad
        with pytest.raises(ValueError, match=r"1 row\(s\) \(first: \[1\]\)"):
            sample_next(logits, temperature=temperature, top_p=0.9, generator=None)
    with pytest.raises(ValueError, match=r"all -inf"):
        sample_next(torch.full((1, 4), -float("inf")), temperature=temperature, top_p=1.0,
                    generator=None)
    tok = CharTokenizer()
    pol = Policy(Decoder(DecoderConfig(vocab_size=tok.vocab_size, d_model=32)), tok, "nan")
    with torch.no_grad():
        pol.model.embed.weight[5] = float("nan")  # diverged (tied: every row's logit 5)
    with pytest.raises(ValueError, match="policy 'nan', new token 0: logits of 2 row"):
        generate(pol, [[6, 7], [5, 6]], num_samples=1, max_new_tokens=3,
                 temperature=temperature, generator=torch.Generator().manual_seed(0))


def test_tiny_temperature_samples_the_argmax():
    """logits / 1e-40 overflowed the largest logit to inf (softmax NaN, torch's multinomial
    error); a temperature close to 0 must behave like greedy."""
    logits = torch.tensor([[1.0, 3.0, 2.9, -float("inf")], [0.5, -2.0, 0.4, 0.0]])
    for top_p in (1.0, 0.5):
        tok, lp = sample_next(logits, temperature=1e-40, top_p=top_p,
                              generator=torch.Generator().manual_seed(0))
        assert tok.tolist() == [1, 0] and lp.tolist() == [0.0, 0.0]
