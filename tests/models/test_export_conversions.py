"""What `hacpo export` converts: the plain-torch decoder as transformers' LlamaForCausalLM
(every tensor mapped, the same logits and greedy answers) and the char tokenizer as a
transformers fast tokenizer (the same ids and text)."""
import pytest
import torch

from hacpo.models.decoder import Decoder, DecoderConfig, to_llama
from hacpo.models.generation import generate
from hacpo.models.policy import Policy
from hacpo.models.tokenizer import CHAR_SET, load_tokenizer

transformers = pytest.importorskip("transformers")


# norm_eps 1e-3: neither the decoder's default nor Llama's (a dropped rms_norm_eps shows)
def _decoder(tie: bool, dtype=torch.float32, seed=0) -> Decoder:
    torch.manual_seed(seed)
    d = Decoder(DecoderConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_len=96,
                              rope_theta=5000.0, norm_eps=1e-3, tie_embeddings=tie))
    with torch.no_grad():        # spread weights (init is 0.02): logits far apart, norms != 1
        for p in d.parameters():
            p.normal_(0.1, 0.3)
    return d.to(dtype).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_every_tensor_is_mapped_and_the_logits_are_the_decoders(tie):
    d = _decoder(tie)
    llama = to_llama(d, eos_id=2, pad_id=0, bos_id=1)
    c, D, F = d.cfg, d.cfg.d_model, d.cfg.d_ff
    lc = llama.config
    assert (lc.num_key_value_heads, lc.rms_norm_eps, lc.max_position_embeddings,
            lc.rope_parameters["rope_theta"], lc.intermediate_size) == (4, 1e-3, 96, 5000.0, F)
    got = llama.state_dict()
    b = d.blocks[1]
    assert torch.equal(got["model.layers.1.self_attn.q_proj.weight"], b.attn.qkv.weight[:D])
    assert torch.equal(got["model.layers.1.self_attn.k_proj.weight"], b.attn.qkv.weight[D:2 * D])
    assert torch.equal(got["model.layers.1.self_attn.v_proj.weight"], b.attn.qkv.weight[2 * D:])
    assert torch.equal(got["model.layers.1.mlp.gate_proj.weight"], b.mlp.gate_up.weight[:F])
    assert torch.equal(got["model.layers.1.mlp.up_proj.weight"], b.mlp.gate_up.weight[F:])
    assert torch.equal(got["model.layers.1.post_attention_layernorm.weight"], b.mlp_norm.weight)
    assert torch.equal(got["lm_head.weight"], d.output_weight)
    assert (llama.lm_head.weight is llama.model.embed_tokens.weight) is tie
    # copies: training the decoder further does not change the export
    assert all(t.data_ptr() != p.data_ptr() for t in got.values() for p in d.parameters())
    ids = torch.randint(0, c.vocab_size, (3, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, theirs = d(ids), llama(ids).logits
    assert want.abs().max() > 1             # the tolerance can fail: logits spread over units
    torch.testing.assert_close(theirs, want, rtol=0, atol=1e-5)
    # a swapped gate / up split is far off (what the tolerance is there to catch)
    with torch.no_grad():
        g = llama.model.layers[0].mlp
        g.gate_proj.weight, g.up_proj.weight = g.up_proj.weight, g.gate_proj.weight
        assert (llama(ids).logits - want).abs().max() > 0.1


def test_greedy_answers_and_bfloat16():
    """transformers' generate (its own KV cache) on the export = hacpo's sampler on the decoder;
    a bf16 decoder gives a bf16 Llama with the same tensors."""
    tok = load_tokenizer("char")
    d = _decoder(True, seed=3)
    pol = Policy(d, tok, "char")
    llama = to_llama(d, eos_id=tok.eos_id, pad_id=tok.pad_id, bos_id=tok.bos_id)
    for q in ("What is 2+3?", "Tom has 4 pens."):
        p = tok.prompt_ids(q)
        ours = generate(pol, [p], num_samples=1, max_new_tokens=16, temperature=0.0)
        out = llama.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                             dtype=torch.long), do_sample=False, max_new_tokens=16,
                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        assert out[0, len(p):].tolist() == ours.response_ids[0]
    bf = to_llama(d.to(torch.bfloat16))
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf.model.layers[0].self_attn.o_proj.weight,
                       d.blocks[0].attn.out.weight)


def test_char_tokenizer_as_a_transformers_tokenizer(tmp_path):
    """Saved and loaded by AutoTokenizer: the same ids for every character of the set (and
    <unk> for others, as errors="fallback"), the same text back, the four special tokens."""
    tok = load_tokenizer("char")
    tok.to_hf().save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
    assert len(hf) == tok.vocab_size
    texts = [CHAR_SET, "Q: What is 2+3?\nA: 5", "  two  spaces\n\n\nand tabs\tnaïve", "a" * 300]
    for t in texts:
        want = tok.encode(t, errors="fallback")
        assert hf(t, add_special_tokens=False)["input_ids"] == want, t
        assert hf.decode(want, skip_special_tokens=True) == tok.decode(want)
    assert tok.encode("naïve\t", errors="fallback").count(tok.unk_id) == 2
    # the default add_special_tokens=True puts BOS first, as prompt_ids does
    q = "What is 2+3?"
    assert hf(tok.prompt_text(q))["input_ids"] == tok.prompt_ids(q)
    # the one difference: a text spelling a special token is that token for transformers
    assert hf("<eos>", add_special_tokens=False)["input_ids"] == [tok.eos_id]
    assert tok.encode("<eos>") == [tok._stoi[ch] for ch in "<eos>"]


def test_to_llama_names_the_special_ids_and_leaves_the_random_stream():
    """The Llama's config and generation config carry the ids given (what generate stops and
    pads at), it is in eval mode, and building it draws nothing from torch's global random
    stream (its random init is overwritten: an export must not change a run's later draws)."""
    d = _decoder(True)
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    llama = to_llama(d, eos_id=2, pad_id=0, bos_id=1)
    assert torch.equal(torch.rand(4), want)
    for c in (llama.config, llama.generation_config):
        assert (c.eos_token_id, c.pad_token_id, c.bos_token_id) == (2, 0, 1)
    assert not llama.training
