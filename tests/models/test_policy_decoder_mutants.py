"""Policy (policy.py) and plain decoder (decoder.py) behaviour a mutation audit found untested:
the errors for bad input (each names what is wrong instead of failing later, or silently
scoring the wrong positions), build_policy's config fields (dtype, seed, lm_head), and the
decoder's config, cache and prefix checks."""
import pytest
import torch

from hacpo.models.decoder import Decoder, DecoderConfig
from hacpo.models.policy import Policy, PolicyConfig, build_policy
from hacpo.models.tokenizer import load_tokenizer


def _decoder(**kw):
    torch.manual_seed(0)
    return Decoder(DecoderConfig(**{"vocab_size": 50, "d_model": 32, "n_layers": 1,
                                    "n_heads": 4, "max_len": 16, **kw}))


# -- Decoder --------------------------------------------------------------------------------


def test_decoder_config_checks_and_default_d_ff():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        DecoderConfig(vocab_size=10, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="head dim must be even"):
        DecoderConfig(vocab_size=10, d_model=12, n_heads=4)
    # about 8/3 * d_model, rounded up to a multiple of 8
    assert DecoderConfig(vocab_size=10, d_model=64).d_ff == 176
    assert DecoderConfig(vocab_size=10, d_model=96).d_ff == 256
    assert DecoderConfig(vocab_size=10, d_model=64, d_ff=100).d_ff == 100


def test_decoder_init_and_untied_output_weight():
    m = _decoder(tie_embeddings=False)
    assert m.output_weight is m.lm_head.weight and m.lm_head.weight is not m.embed.weight
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(m(ids), m.hidden(ids) @ m.lm_head.weight.t())
    # weights drawn with std 0.02 (1600 samples: the estimate is within 5%)
    for w in (m.embed.weight, m.lm_head.weight):
        assert 0.019 < float(w.detach().std()) < 0.021


def test_decoder_integer_attention_mask_is_a_bool_one():
    """A 0/1 integer mask (the Hugging Face convention) gives the bool mask's hidden states."""
    m = _decoder()
    ids = torch.tensor([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert torch.equal(m.hidden(ids, mask), m.hidden(ids, mask.bool()))


def test_decoder_cache_errors():
    m = _decoder()
    with pytest.raises(ValueError, match="cache length 17 exceeds max_len=16"):
        m.new_cache(1, 17)
    cache = m.new_cache(1, 4)
    ids = torch.tensor([[1, 2, 3]])
    m.hidden(ids, cache=cache)
    assert cache.length == 3
    with pytest.raises(ValueError, match="position_ids are required when decoding with a "
                                         "non-empty cache"):
        m.hidden(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match=r"cache overflow: 5 > 4 slots"):
        m.hidden(ids[:, :2], position_ids=torch.tensor([[3, 4]]), cache=cache)


def test_decoder_encode_prefix_errors():
    m = _decoder()
    with pytest.raises(ValueError, match="prefix of 17 tokens exceeds max_len=16"):
        m.encode_prefix(torch.ones(1, 17, dtype=torch.long), torch.ones(1, 17))
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="every prefix needs at least one real token"):
        m.encode_prefix(torch.ones(2, 3, dtype=torch.long), mask)


# -- Policy ---------------------------------------------------------------------------------


def test_policy_construction_errors():
    tok = load_tokenizer("char")
    V = tok.vocab_size
    with pytest.raises(ValueError, match=r"policy 'x': lm_head must be one of logits, fused, "
                                         r"got 'fast'"):
        Policy(_decoder(vocab_size=V), tok, "x", lm_head="fast")
    # one output id short of the tokenizer: the last id would index past the embedding table
    with pytest.raises(ValueError, match=rf"policy 'x': model has {V - 1} output ids but "
                                         rf"tokenizer 'char' has {V}"):
        Policy(_decoder(vocab_size=V - 1), tok, "x")
    assert Policy(_decoder(vocab_size=V + 3), tok, "x").output_weight.shape[0] == V + 3


def test_hf_output_layer_check_keeps_train_mode_and_reads_softcapping():
    """The build's one-forward check puts the model in eval mode for the forward only; any
    final_logit_softcapping is refused (a cap of 1 too), a logit_scale of 1 is not."""
    pol = build_policy(PolicyConfig(name="l", kind="hf", arch="llama", seed=1))
    model, tok = pol.model, pol.tokenizer
    assert not model.training                  # built in eval mode, left so
    model.train()
    assert Policy(model, tok, "t").model.training
    model.config.logit_scale = 1.0
    Policy(model, tok, "t")
    model.config.logit_scale = 2.0
    with pytest.raises(ValueError, match="config sets logit_scale=2.0"):
        Policy(model, tok, "t")
    del model.config.logit_scale
    model.config.final_logit_softcapping = 1.0
    with pytest.raises(ValueError, match="config sets final_logit_softcapping=1.0"):
        Policy(model, tok, "t")


def test_response_logprobs_input_errors(policy):
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        policy.response_logprobs([[5, 6], [7]], [[8]])
    # an empty prompt has no position predicting the response's first token (it read the
    # last position of the row instead)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        policy.response_logprobs([[], [5]], [[6], [7]])


def test_continuation_logprobs_input_errors(policy):
    states = policy.encode_prompts([[5, 6, 7]])
    with pytest.raises(ValueError, match="1 prompt indices but 2 responses"):
        policy.continuation_logprobs(states, [0], [[8], [9]])
    # a negative index would pick a prompt from the end
    with pytest.raises(ValueError, match=r"prompt index out of range \[0, 1\)"):
        policy.continuation_logprobs(states, [-1], [[8]])


def test_decoder_continuation_past_max_len_is_refused():
    """continuation_logprobs leaves the position limit to the decoder: a prompt + response of
    max_len tokens is scored, one more is an error (positions are computed, not looked up, so
    nothing else would stop it)."""
    pol = build_policy(PolicyConfig(name="d", kind="decoder", seed=1, d_model=16, n_layers=1,
                                    n_heads=2, max_len=24))
    states = pol.encode_prompts([[5] * 20, [5, 6]])
    lp, mask = pol.continuation_logprobs(states, [0, 1], [[6] * 4, [7] * 5])
    assert mask.sum() == 9 and torch.isfinite(lp).all()
    with pytest.raises(ValueError, match="prefix \\+ continuation exceeds max_len=24"):
        pol.continuation_logprobs(states, [1, 0], [[7] * 5, [6] * 5])


def test_all_empty_responses_give_empty_rows(policy):
    lp, mask = policy.continuation_logprobs(policy.encode_prompts([[5, 6]]), [0, 0], [[], []])
    assert lp.shape == mask.shape == (2, 0)
    lp, mask = policy.response_logprobs([[5, 6], [5, 6]], [[], []])
    assert lp.shape == mask.shape == (2, 0)


def test_build_policy_config_fields():
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'; one of \['bfloat16', "
                                         r"'float16', 'float32'\]"):
        build_policy(PolicyConfig(dtype="float8"))
    with pytest.raises(ValueError, match="unknown policy kind 'rnn'; one of 'decoder', 'hf'"):
        build_policy(PolicyConfig(kind="rnn"))
    small = dict(d_model=16, n_layers=1, n_heads=2, max_len=32)
    pol = build_policy(PolicyConfig(dtype="bfloat16", lm_head="fused", **small))
    assert pol.lm_head == "fused"
    assert {p.dtype for p in pol.parameters()} == {torch.bfloat16}
    # the weights come from the config's seed alone, and torch's global RNG is left as it was
    torch.manual_seed(123)
    a = build_policy(PolicyConfig(seed=5, **small))
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)
    b = build_policy(PolicyConfig(seed=5, **small))
    c = build_policy(PolicyConfig(seed=6, **small))
    assert torch.equal(a.output_weight, b.output_weight)
    assert not torch.equal(a.output_weight, c.output_weight)


def test_reduced_vocab_with_a_full_vocabulary_checkpoint_is_refused(tmp_path, qwen3_reduced):
    """policy.path of a model with its own (here: char) vocabulary and reduce_vocab: the
    reduced ids would read other tokens' embedding rows."""
    pol = build_policy(PolicyConfig(name="c", kind="hf", arch="llama", seed=1))
    pol.model.save_pretrained(tmp_path)
    V = qwen3_reduced.vocab_size
    with pytest.raises(ValueError, match=rf"'q': policy.reduce_vocab=True renumbers .*ids "
                                         rf"0..{V - 1}, but the model .*embedding table of 91 "
                                         rf"rows"):
        build_policy(PolicyConfig(name="q", kind="hf", path=str(tmp_path), tokenizer="qwen3",
                                  reduce_vocab=True), tokenizer=qwen3_reduced)
