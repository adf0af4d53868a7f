import pytest
import torch

from hacpo.models.decoder import Decoder, DecoderConfig
from hacpo.models.hf import load_hf_model
from hacpo.models.policy import PolicyConfig, build_policy
from hacpo.models.tokenizer import load_tokenizer

QUESTIONS = ["What is 2+3?", "Tom has 12 apples and eats 5. How many are left?", "7*8=?"]


def _manual_logprobs(policy, prompt, response):
    """One row, no padding: full forward, log-softmax over the whole sequence."""
    ids = torch.tensor([prompt + response])
    logits = policy.forward_logits(ids, torch.ones_like(ids, dtype=torch.bool))[0]
    lp = torch.log_softmax(logits.double(), -1)
    return torch.stack([lp[len(prompt) - 1 + j, t] for j, t in enumerate(response)]).float()


def _batch(policy):
    tok = policy.tokenizer
    g = torch.Generator().manual_seed(0)
    prompts = [tok.prompt_ids(q) for q in QUESTIONS]
    responses = [torch.randint(4, tok.vocab_size, (n,), generator=g).tolist() for n in (5, 1, 9)]
    responses[0][-1] = tok.eos_id
    return prompts, responses


def test_response_logprobs_matches_manual_and_padding_invariant(policy):
    prompts, responses = _batch(policy)
    lp, mask = policy.response_logprobs(prompts, responses)
    assert lp.dtype == torch.float32 and mask.dtype == torch.bool
    assert lp.shape == mask.shape == (3, 9)
    assert mask.sum(-1).tolist() == [5, 1, 9]
    assert (lp[~mask] == 0).all()
    for b in range(3):
        manual = _manual_logprobs(policy, prompts[b], responses[b])
        # fp32 forward vs fp64 log-softmax of the same fp32 logits: rounding only.
        torch.testing.assert_close(lp[b, mask[b]], manual, atol=1e-5, rtol=1e-5)
        alone, _ = policy.response_logprobs([prompts[b]], [responses[b]])
        # Batch neighbours change only the padding (and matmul shapes): rounding only.
        torch.testing.assert_close(lp[b, mask[b]], alone[0], atol=1e-5, rtol=1e-5)


def test_response_logprobs_is_differentiable_and_temperature(policy):
    prompts, responses = _batch(policy)
    lp, mask = policy.response_logprobs(prompts, responses)
    policy.zero_grad()
    lp[mask].sum().backward()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    policy.zero_grad()
    with torch.no_grad():
        lp_t, _ = policy.response_logprobs(prompts, responses, temperature=0.5)
        ids = torch.tensor([prompts[1] + responses[1]])
        logits = policy.forward_logits(ids, torch.ones_like(ids, dtype=torch.bool))[0]
        manual = torch.log_softmax(logits[len(prompts[1]) - 1] / 0.5, -1)[responses[1][0]]
    torch.testing.assert_close(lp_t[1, 0], manual, atol=1e-5, rtol=1e-5)


def test_shared_prompt_forward_equals_one_sequence_per_row():
    """Rows sharing a prompt (G samples, self + cross) forward it once (plain decoder): same
    log-probs and gradients as the full per-row forward, with unequal prompt and response
    lengths, an empty response and a prompt used once."""
    policy = build_policy(PolicyConfig(name="d", kind="decoder", seed=1))
    prompts, responses = _batch(policy)
    g = torch.Generator().manual_seed(1)
    P, R = [], []
    for i in range(14):
        P.append(prompts[i % 2])
        R.append(torch.randint(4, policy.tokenizer.vocab_size,
                               (int(torch.randint(0, 11, (1,), generator=g)),),
                               generator=g).tolist())
    R[3] = []
    P.append(prompts[2])
    R.append(responses[2])
    w = torch.randn(len(P), 10, generator=g)

    def run(share):
        policy.share_prompts = share
        policy.zero_grad()
        lp, mask = policy.response_logprobs(P, R, temperature=0.7)
        (lp * w[:, :lp.shape[1]]).sum().backward()
        return lp.detach(), mask, [p.grad.clone() for p in policy.parameters()]

    try:
        full, m_full, g_full = run(False)
        shared, m_shared, g_shared = run(True)
    finally:
        policy.share_prompts = True
    assert torch.equal(m_full, m_shared) and m_full[3].sum() == 0
    # fp32, same math in a different grouping of the same matmuls: rounding only (a wrong
    # position, mask or prompt assignment moves log-probs by O(0.1) and grads by O(1))
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_shared, g_full):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert max(g.abs().max() for g in g_full) > 1e-2      # the comparison is not vacuous


def test_shared_prompts_near_max_len():
    """Prompt states at the position limit: a row that exactly fills max_len next to a short
    row (whose padding runs past max_len) gives the whole-sequence log-probs; one token more is
    an error naming the limit, on both paths."""
    policy = build_policy(PolicyConfig(name="d", kind="decoder", seed=1, max_len=24))
    g = torch.Generator().manual_seed(2)
    V = policy.tokenizer.vocab_size
    long_p, short_p = torch.randint(4, V, (20,), generator=g).tolist(), [5, 6, 7]
    P = [long_p, long_p, short_p, short_p]
    R = [torch.randint(4, V, (n,), generator=g).tolist() for n in (4, 2, 5, 3)]

    def run(share, R=R):
        policy.share_prompts = share
        return policy.response_logprobs(P, R)

    try:
        full, mask = run(False)
        shared, mask_s = run(True)
        torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
        assert torch.equal(mask, mask_s) and mask.sum(-1).tolist() == [4, 2, 5, 3]
        too_long = [R[0] + [9]] + R[1:]
        for share in (False, True):
            with pytest.raises(ValueError, match=r"exceeds max_len=24"):
                run(share, too_long)
    finally:
        policy.share_prompts = True


def test_empty_response_row_is_all_masked(policy):
    prompts, responses = _batch(policy)
    lp, mask = policy.response_logprobs(prompts[:2], [responses[0], []])
    assert mask[1].sum() == 0 and mask[0].sum() == 5


def test_decoder_kv_cache_equals_full_recompute():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=64))
    ids = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False  # row 1 is left-padded
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    full = model(ids, mask, pos)
    cache = model.new_cache(2, 12)
    parts = [model(ids[:, :5], mask[:, :5], pos[:, :5], cache)]
    for t in range(5, 12):
        parts.append(model(ids[:, t:t + 1], mask[:, t:t + 1], pos[:, t:t + 1], cache))
    inc = torch.cat(parts, 1)
    real = mask  # logits at padding slots are meaningless
    torch.testing.assert_close(inc[real], full[real], atol=1e-5, rtol=1e-5)
    # Row 1 without its padding gives the same logits.
    alone = model(ids[1:, 4:])
    torch.testing.assert_close(full[1, 4:], alone[0], atol=1e-5, rtol=1e-5)


def test_build_policy_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no HF model at"):
        load_hf_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        build_policy(PolicyConfig(kind="hf", path=str(tmp_path)))
    with pytest.raises(ValueError, match="unknown HF architecture 'mamba'"):
        build_policy(PolicyConfig(kind="hf", arch="mamba"))
    with pytest.raises(ValueError, match="needs a corpus"):
        build_policy(PolicyConfig(tokenizer="qwen3", reduce_vocab=True))
    with pytest.raises(ValueError, match="kept= is a reduced vocabulary, and reduce_vocab is "
                                         "False"):
        build_policy(PolicyConfig(tokenizer="qwen3"), kept=list(range(300)))
    with pytest.raises(FileNotFoundError, match="nope-tokenizer"):
        build_policy(PolicyConfig(tokenizer="nope-tokenizer"))


def test_reduced_vocab_policy_and_local_checkpoint_roundtrip(tmp_path, qwen3_reduced):
    cfg = PolicyConfig(name="q", kind="hf", arch="qwen2", tokenizer="qwen3", seed=3)
    pol = build_policy(cfg, tokenizer=qwen3_reduced)
    assert pol.output_weight.shape[0] == qwen3_reduced.vocab_size
    pol.model.save_pretrained(tmp_path)
    loaded = build_policy(PolicyConfig(kind="hf", path=str(tmp_path)), tokenizer=qwen3_reduced)
    prompts = [qwen3_reduced.prompt_ids("Tom has 3 apples.")]
    responses = [qwen3_reduced.response_ids("The answer is 11.", add_eos=True)]
    a, _ = pol.response_logprobs(prompts, responses)
    b, _ = loaded.response_logprobs(prompts, responses)
    torch.testing.assert_close(a, b)


def test_char_decoder_size_matches_benchmark_preset():
    pol = build_policy(PolicyConfig(kind="decoder", tokenizer="char", d_model=96, n_layers=4,
                                    n_heads=4))
    assert 0.35e6 < sum(p.numel() for p in pol.parameters()) < 0.5e6
    assert pol.tokenizer.vocab_size == load_tokenizer("char").vocab_size


@pytest.mark.parametrize("kind", ["decoder", "llama"])
def test_fused_lm_head_equals_logits(kind, qwen3):
    """policy.lm_head="fused" (projection + log-softmax in row chunks, no [T, V] logits): the
    same log-probs and parameter gradients as "logits", on the whole-sequence path and the
    shared-prompt path, at temperature 0.7; the llama's embedding table is padded past the
    tokenizer's vocabulary (those rows must stay out of the softmax and get no gradient)."""
    import copy

    if kind == "decoder":
        base = build_policy(PolicyConfig(name="d", kind="decoder", seed=1))
    else:
        base = build_policy(PolicyConfig(name="l", kind="hf", arch="llama", tokenizer="qwen3",
                                         seed=2, hf_config={"hidden_size": 32,
                                                            "intermediate_size": 64,
                                                            "num_hidden_layers": 2,
                                                            "num_attention_heads": 4,
                                                            "num_key_value_heads": 2}),
                            tokenizer=qwen3)
        base.model.resize_token_embeddings(qwen3.vocab_size + 7, mean_resizing=False)
        with torch.no_grad():       # large padding rows: a leak into the softmax would show
            base.output_weight[qwen3.vocab_size:] = 3.0
    prompts, responses = _batch(base)
    prompts = [prompts[0], prompts[0], prompts[2]]           # rows 0 and 1 share a prompt
    results = {}
    for head in ("logits", "fused"):
        for shared in (False, True):
            pol = copy.deepcopy(base)
            pol.lm_head, pol.share_prompts = head, shared
            lp, mask = pol.response_logprobs(prompts, responses, temperature=0.7)
            (lp[mask] * torch.linspace(-1, 1, int(mask.sum()))).sum().backward()
            results[head, shared] = (lp.detach(), {n: p.grad.clone() for n, p in
                                                   pol.named_parameters() if p.grad is not None})
    for shared in (False, True):
        (lp_a, g_a), (lp_b, g_b) = results["logits", shared], results["fused", shared]
        # fp32: the same GEMM rows and log-softmax kernel; the fused backward recomputes the
        # projection and sums the same terms in another order (seen <= 1e-7)
        torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=0)
        assert g_a.keys() == g_b.keys() and g_a
        for n in g_a:
            scale = max(g_a[n].abs().max().item(), 1e-3)
            torch.testing.assert_close(g_b[n], g_a[n], atol=1e-5 * scale, rtol=0, msg=n)
    if kind == "llama":                      # the padded rows: no gradient either way
        V = qwen3.vocab_size
        for _, g in results.values():
            w = [t for n, t in g.items() if n.endswith("embed_tokens.weight")
                 or n.endswith("lm_head.weight")]
            assert w and all(torch.count_nonzero(t[V:]) == 0 for t in w)


def test_hf_config_unknown_key_is_an_error_not_the_default_model():
    """transformers keeps a misspelt key as an extra attribute: hf_config={"hiden_size": 128}
    used to build the default 64-wide model silently."""
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['hiden_size'\].*LlamaConfig"):
        build_policy(PolicyConfig(name="h", kind="hf", arch="llama",
                                  hf_config={"hiden_size": 128}))
    with pytest.raises(ValueError, match=r"\['n_embed'\].*GPT2Config"):
        build_policy(PolicyConfig(name="g", kind="hf", arch="gpt2", hf_config={"n_embed": 32}))
    # real keys (gpt2's attribute-map aliases, keys the config folds into others) still work,
    # and the caller's nested dicts are left as given
    scaling = {"rope_type": "linear", "factor": 2.0}
    pol = build_policy(PolicyConfig(name="h", kind="hf", arch="llama", hf_config={
        "hidden_size": 32, "rope_theta": 5e5, "rope_scaling": scaling}))
    assert pol.model.config.hidden_size == 32
    assert pol.model.config.rope_parameters["rope_theta"] == 5e5
    assert pol.model.config.rope_parameters["factor"] == 2.0
    assert scaling == {"rope_type": "linear", "factor": 2.0}
    assert build_policy(PolicyConfig(name="g", kind="hf", arch="gpt2", hf_config={
        "hidden_size": 32})).model.config.n_embd == 32


def test_out_of_vocab_ids_and_empty_batch(policy):
    """An id outside the tokenizer used to fail inside the embedding ("index out of range in
    self"; a device assert on CUDA); an empty batch failed in max()."""
    V = policy.tokenizer.vocab_size
    for prompts, responses, match in (([[1, 2]], [[V]], f"prompt or response id {V} is"),
                                      ([[-1, 2]], [[3]], "prompt or response id -1 is"),
                                      ([[V + 3], [V + 3]], [[3], [4]], f"prompt id {V + 3} is")):
        with pytest.raises(ValueError,
                           match=rf"policy '{policy.name}': {match} outside the vocabulary"):
            policy.response_logprobs(prompts, responses)
    states = policy.encode_prompts([[1, 2]])
    with pytest.raises(ValueError, match=f"response id {V + 1} is outside"):
        policy.continuation_logprobs(states, [0], [[3, V + 1]])
    lp, mask = policy.response_logprobs([], [])
    assert lp.shape == mask.shape == (0, 0)
    # no prompt at all: the same error for every kind (HF models failed in a reshape)
    with pytest.raises(ValueError, match="encode_prompts: needs at least one prompt"):
        policy.encode_prompts([])


def test_hf_model_whose_logits_are_not_the_plain_projection_is_refused(tmp_path):
    """Teacher forcing projects hidden states with the output weight alone; a local Phi
    checkpoint (output-layer bias) used to be trained on log-probs 2 nats away from the ones
    it sampled, silently; so did Gemma 2 (logit soft-capping)."""
    from transformers import AutoModelForCausalLM, PhiConfig

    from hacpo.models.policy import Policy

    phi = AutoModelForCausalLM.from_config(PhiConfig(
        vocab_size=91, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=64))
    phi.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'phi': PhiForCausalLM is not supported.*has a bias"):
        build_policy(PolicyConfig(name="phi", kind="hf", path=str(tmp_path)))

    class ScaledHead(torch.nn.Linear):          # what no config key announces
        def forward(self, x):
            return 2 * super().forward(x)

    pol = build_policy(PolicyConfig(name="l", kind="hf", arch="llama", seed=1,
                                    hf_config={"tie_word_embeddings": False}))
    model, tok = pol.model, pol.tokenizer
    head = ScaledHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    with pytest.raises(ValueError, match="'s': LlamaForCausalLM .*logits differ"):
        Policy(model, tok, "s")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="config sets final_logit_softcapping=30.0"):
        Policy(model, tok, "s")


def test_checkpoint_missing_weights_is_an_error_not_random_weights(tmp_path):
    """transformers initializes weights a checkpoint lacks at random and only logs a report: a
    policy loaded from such a directory used to start from random layers, silently."""
    from safetensors.torch import load_file, save_file

    from hacpo.models.hf import build_hf_model

    for arch, tied in (("gpt2", True), ("llama", True), ("llama", False)):   # complete: loads
        d = tmp_path / f"{arch}-{tied}"
        model = build_hf_model({"arch": arch, "tie_word_embeddings": tied}, vocab_size=91)
        model.save_pretrained(d)
        loaded = load_hf_model(str(d))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     loaded.state_dict().values()))
    weights = d / "model.safetensors"
    sd = load_file(weights)
    del sd["lm_head.weight"], sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not hold all of LlamaForCausalLM's weights.*"
                                         r"missing keys: \['lm_head.weight', "
                                         r"'model.layers.1.mlp.down_proj.weight'\]"):
        build_policy(PolicyConfig(kind="hf", path=str(d)))


def test_hf_policy_pickles_after_its_build_checks():
    """The Ray pools and trainer actors ship policies by pickling them: the build's output-layer
    check must leave no hook behind (transformers' output_hidden_states installs unpicklable
    output-capturing hooks on the modules)."""
    import pickle

    for arch in ("llama", "qwen2", "gpt2"):
        pol = build_policy(PolicyConfig(name="p", kind="hf", arch=arch))
        back = pickle.loads(pickle.dumps(pol))
        assert torch.equal(back.output_weight, pol.output_weight)
