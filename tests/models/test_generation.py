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

    def hidden(self, input_ids, attention_mask=None, position_ids=None, cache=None,
               check_positions=True):
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
    (dict(temperature=True), "temperature must be a real number, got True"),
    (dict(top_p=float("nan")), "top_p=nan"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0, got -1"),
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


def _sample_next_multinomial(logits, *, temperature, top_p, generator):
    """The sampler before it stopped reading the device (torch.multinomial): the reference."""
    logits = logits.float()
    top = logits.amax(-1, keepdim=True)
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    probs = torch.softmax((logits - top) / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.7, 0.9), (1.3, 0.5),
                                                (1e-3, 1.0)])
def test_sampler_draws_exactly_what_torch_multinomial_drew(temperature, top_p):
    """The sampler no longer calls torch.multinomial (two device->host reads per call): same
    tokens and log-probs, bit for bit, from the same generator draws (several calls in a row
    on one generator, so the generator advances alike)."""
    for seed in range(5):
        x = torch.randn(64, 300, generator=torch.Generator().manual_seed(100 + seed)) * 3
        x[:, ::7] = -float("inf")          # zero-probability tokens
        x[::5] = x[::5].to(torch.bfloat16).float()  # ties
        ga, gb = (torch.Generator().manual_seed(seed) for _ in range(2))
        for _ in range(3):
            ta, la = sample_next(x, temperature=temperature, top_p=top_p, generator=ga)
            tb, lb = _sample_next_multinomial(x, temperature=temperature, top_p=top_p,
                                              generator=gb)
            assert torch.equal(ta, tb) and torch.equal(la, lb)
            assert torch.isfinite(x.gather(-1, ta[:, None])).all()  # never a -inf token
    assert torch.equal(ga.get_state(), gb.get_state())


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.7, 0.5)])
def test_sampler_core_flags_rows_without_a_distribution_and_samples_the_rest(temperature,
                                                                            top_p):
    """generate's sampler reads nothing back: a NaN / +inf / all -inf row is flagged, not
    raised on (torch.multinomial used to raise its own error), and the other rows are
    sampled exactly as without it."""
    from hacpo.models.generation import _sample

    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    bad = x.clone()
    bad[1, 4], bad[3, 0], bad[4] = float("nan"), float("inf"), -float("inf")
    tok, lp, flags = _sample(bad, temperature=temperature, top_p=top_p,
                             generator=torch.Generator().manual_seed(1))
    assert flags.tolist() == [False, True, False, True, True, False]
    assert ((tok >= 0) & (tok < 40)).all()
    ref_tok, ref_lp = sample_next(x, temperature=temperature, top_p=top_p,
                                  generator=torch.Generator().manual_seed(1))
    good = ~flags
    assert torch.equal(tok[good], ref_tok[good]) and torch.equal(lp[good], ref_lp[good])


class _PoisonedScript(ScriptedDecoder):
    """ScriptedDecoder whose logits are NaN after reading one of ``poison`` tokens."""

    def __init__(self, tok, next_token, poison):
        super().__init__(tok, next_token)
        self.poison = list(poison)

    def hidden(self, input_ids, attention_mask=None, position_ids=None, cache=None,
               check_positions=True):
        h = super().hidden(input_ids, attention_mask, position_ids, cache)
        hit = torch.isin(input_ids, torch.tensor(self.poison))
        return h.masked_fill(hit[..., None], float("nan"))


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_non_finite_logits_of_finished_rows_are_ignored(temperature):
    """A row that produced EOS keeps decoding padding, and its tokens are thrown away: NaN
    logits there (a model whose pad embedding is NaN, say) used to fail the whole rollout.
    A row still decoding with NaN logits is still a clear error at the right new token."""
    tok = CharTokenizer()
    d = [tok.encode(str(i))[0] for i in range(10)]
    script = {d[i]: d[i + 1] for i in range(9)} | {d[9]: tok.eos_id}
    pol = Policy(_PoisonedScript(tok, script, poison=[tok.pad_id]), tok, "p")
    prompts = [tok.encode("x=8"), tok.encode("y=3")]
    g = torch.Generator().manual_seed(0)
    ro = generate(pol, prompts, num_samples=2, max_new_tokens=6, temperature=temperature,
                  generator=g)
    assert [tok.decode(r) for r in ro.response_ids] == ["9", "9", "456789", "456789"]
    assert ro.finished_eos == [True, True, False, False]
    assert all(x == x for row in ro.sampler_logprobs for x in row)  # no NaN kept

    pol = Policy(_PoisonedScript(tok, script, poison=[d[6]]), tok, "p6")  # y=3: 4 5 6 NaN
    with pytest.raises(ValueError, match=r"policy 'p6', new token 3: logits of 2 row\(s\) "
                                         r"\(first: \[2, 3\]\) are NaN"):
        generate(pol, prompts, num_samples=2, max_new_tokens=6, temperature=temperature,
                 generator=g)


class _SyncFreeEcho(Decoder):
    """Logits favour the last input token by 100 nats (never EOS after a digit); reads
    nothing back from the device (Decoder.hidden's position check does)."""

    def __init__(self, tok):
        super().__init__(DecoderConfig(vocab_size=tok.vocab_size, d_model=96, n_heads=4))
        with torch.no_grad():
            self.embed.weight.copy_(torch.eye(tok.vocab_size, 96))

    def hidden(self, input_ids, attention_mask=None, position_ids=None, cache=None,
               check_positions=True):
        if cache is not None:
            cache.length += input_ids.shape[1]
        return 100 * self.embed.weight[input_ids]


def _device_reads(monkeypatch, fn) -> int:
    """Host syncs done by ``fn()``: scalar reads (``item``/``bool``/``int``/``float``, also
    inside torch ops, e.g. torch.multinomial's checks) seen by the profiler, plus ``tolist`` /
    ``cpu`` / ``numpy`` calls (no aten op to see on a CPU tensor)."""
    from torch.profiler import profile

    calls = [0]
    for name in ("tolist", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            calls[0] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    with profile() as prof:
        fn()
    monkeypatch.undo()
    return calls[0] + sum(e.name == "aten::_local_scalar_dense" for e in prof.events())


@pytest.mark.parametrize("temperature, top_p", [(0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_generate_reads_the_device_once_per_new_token(monkeypatch, temperature, top_p):
    """Each host sync stalls a GPU's launch queue: the loop used to read the NaN check and
    the all-finished flag separately, plus torch.multinomial's two validity reads."""
    tok = CharTokenizer()
    pol = Policy(_SyncFreeEcho(tok), tok, "echo")
    prompts = [tok.encode("x=7"), tok.encode("long y=12")]

    def run(n):
        ro = generate(pol, prompts, num_samples=3, max_new_tokens=n, temperature=temperature,
                      top_p=top_p, generator=torch.Generator().manual_seed(0))
        assert ro.response_lengths == [n] * 6 and not any(ro.finished_eos)

    assert _device_reads(monkeypatch, lambda: run(12)) - _device_reads(
        monkeypatch, lambda: run(4)) == 12 - 4


def test_decoder_decode_step_reads_nothing(monkeypatch):
    """The plain-torch decoder's decode step makes no host read (its max_len check read the
    largest position every token; the sampler guarantees positions < max_len)."""
    from hacpo.models.generation import _DecoderStepper

    tok = CharTokenizer()
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2,
                                  max_len=32))
    pol = Policy(model, tok, "dec")
    st = _DecoderStepper(pol, 12)
    ids = torch.tensor([tok.encode("ab=1"), tok.encode("cd=2")])
    st.prefill(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(4).expand(2, 4))
    tokens = torch.tensor([5, 6])
    assert _device_reads(monkeypatch, lambda: [st.step(tokens, torch.tensor([4 + t, 4 + t]))
                                               for t in range(3)]) == 0
    with pytest.raises(ValueError, match=r"position 32 >= max_len=32"):    # checked elsewhere
        model.hidden(ids, position_ids=torch.full((2, 4), 32))
