"""Policy forward contracts no other test pinned down (found by a mutation audit: a changed
default survived every other test, because every caller passes right-padded rows).

``Policy.forward_hidden`` / ``forward_logits`` promise that positions default to the number of
real tokens before each token, so a left-padded row gives the same result as the row alone.
The reference is the model itself run on the unpadded row (transformers' own forward for the HF
policies; the plain decoder on the row alone), not the policy's padded path. With rotary
positions (decoder, llama, qwen2) a common shift of every position changes nothing (attention
sees only relative positions); GPT-2's learned absolute positions are what makes a wrong default
visible."""
import pytest
import torch

from hacpo.models.policy import PolicyConfig, build_policy


@pytest.mark.parametrize("kind,arch", [("decoder", None), ("hf", "llama"), ("hf", "qwen2"),
                                       ("hf", "gpt2")])
def test_left_padded_rows_equal_the_rows_alone(kind, arch):
    cfg = PolicyConfig(name="p", kind=kind, seed=3, **({"arch": arch} if arch else {}))
    policy = build_policy(cfg)
    V = policy.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, V, (n,), generator=g) for n in (7, 4, 1)]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), policy.tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r                  # left padding
        mask[b, L - len(r):] = True
    with torch.no_grad():
        got = policy.forward_logits(ids, mask)
        for b, r in enumerate(rows):
            if kind == "hf":
                ref = policy.model(input_ids=r[None], use_cache=False).logits[0]
            else:
                alone = torch.ones(1, len(r), dtype=torch.bool)
                ref = policy.forward_logits(r[None], alone)[0]
            # fp32, the same math with padded keys masked out: rounding only (seen <= 1e-6);
            # a position shift by the padding moves logits by O(0.1)
            torch.testing.assert_close(got[b, L - len(r):], ref, atol=1e-5, rtol=0,
                                       msg=f"row {b}")
