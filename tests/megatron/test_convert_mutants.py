"""Weight-mapping and architecture details that the other conversion tests could not see
(found by a mutation audit of convert.py / build.py: each test names the mistake it catches).
Pure tensors and megatron's config (one single-process build): a few seconds."""
import pytest
import torch

from hacpo.models.megatron.build import ArchSpec
from hacpo.models.megatron.convert import (fuse_qkv, hf_state_dict, hf_to_megatron,
                                           load_megatron_state, megatron_to_hf, moments_from_hf,
                                           moments_to_hf, split_qkv)
from tests.megatron._workers import tiny_hf


def _arch(**kw):
    base = dict(model_type="llama", num_hidden_layers=2, hidden_size=48, num_attention_heads=6,
                num_key_value_heads=2, intermediate_size=96, vocab_size=96)
    return ArchSpec.from_hf({**base, **kw})


@pytest.mark.parametrize("nq,ng", [(6, 2), (8, 2), (4, 1), (4, 4), (6, 3)])
def test_qkv_groups_of_any_size(nq, ng):
    """Each kv head's group holds its nq/ng query heads (HF's repeat_kv: query head h reads kv
    head h // (nq/ng)), then k_g, then v_g. The tiny test models have nq/ng = ng = 2, where a
    group of ng query heads instead of nq/ng looks the same; here they differ."""
    d = 4
    arch = _arch(hidden_size=nq * d, num_attention_heads=nq, num_key_value_heads=ng)
    assert arch.head_dim == d
    q = torch.arange(nq * d * 3, dtype=torch.float32).reshape(nq * d, 3)
    k, v = -1 - torch.arange(ng * d * 3.0).reshape(ng * d, 3), 1000 + q[:ng * d]
    fused = fuse_qkv(q, k, v, arch)
    r = nq // ng
    expect = torch.cat([torch.cat([q[g * r * d:(g + 1) * r * d], k[g * d:(g + 1) * d],
                                   v[g * d:(g + 1) * d]]) for g in range(ng)])
    assert torch.equal(fused, expect)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, arch), (q, k, v)))
    b = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], arch)            # the Qwen2 bias: 1-d
    assert torch.equal(b, expect[:, 0])


def test_qkv_of_three_query_heads_per_group_shards_and_round_trips():
    """A real HF model with 6 query heads over 2 kv heads: TP rank r holds group r (query
    heads 3r..3r+2, k_r, v_r) and the shards convert back exactly."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, vocab_size=96,
                      max_position_embeddings=32, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    arch = ArchSpec.from_hf(model.config)
    g = torch.Generator().manual_seed(0)       # random biases too (HF initializes them to 0)
    sd = {n: torch.randn(t.shape, generator=g) for n, t in model.state_dict().items()}
    d, a = 8, "model.layers.1.self_attn."
    shards = [[hf_to_megatron(sd, arch, tp=2, tp_rank=r, pp=2, pp_rank=p) for r in range(2)]
              for p in range(2)]
    for name in ("weight", "bias"):
        q, k, v = (sd[a + f"{x}_proj.{name}"] for x in "qkv")
        assert torch.equal(shards[1][1][f"decoder.layers.0.self_attention.linear_qkv.{name}"],
                           torch.cat([q[3 * d:6 * d], k[d:], v[d:]]))
    back = megatron_to_hf(shards, arch)
    assert back.keys() == sd.keys() and all(torch.equal(back[n], sd[n]) for n in sd)


def test_megatron_to_hf_checks_the_layout():
    """Shards of a layout the architecture cannot take: the named error, not an IndexError."""
    arch = _arch(num_hidden_layers=3)
    with pytest.raises(ValueError, match="num_hidden_layers=3 is not divisible by "
                                         "pipeline-parallel size pp=2"):
        megatron_to_hf([[{}], [{}]], arch)


class _WithExtra(torch.nn.Module):
    """A module with megatron-like ``_extra_state`` (as transformer-engine's layers have)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 3, bias=False)
        self.norm = torch.nn.RMSNorm(3)

    def get_extra_state(self):
        return torch.empty(0)

    def set_extra_state(self, state):
        pass


def test_load_megatron_state_is_strict_but_for_extra_state():
    m = _WithExtra()
    w, g = torch.randn(3, 2), torch.randn(3)
    load_megatron_state(m, {"lin.weight": w, "norm.weight": g})   # no _extra_state: fine
    assert torch.equal(m.lin.weight, w) and torch.equal(m.norm.weight, g)
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], unexpected \[\]"):
        load_megatron_state(m, {"lin.weight": w})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['lin.bias'\]"):
        load_megatron_state(m, {"lin.weight": w, "norm.weight": g, "lin.bias": g})


@pytest.mark.parametrize("main", [False, True])
def test_moments_move_between_layouts_as_the_weights_do(main):
    """Adam's state cut for TP=2 x PP=2 (moments_from_hf) and gathered back (moments_to_hf):
    the same HF-named moments and step; each shard's moment is the weight conversion of that
    moment at that shard (padded vocabulary rows zero), and the moments stay apart."""
    model = tiny_hf("qwen2", tie=False, vocab=91)
    arch = ArchSpec.from_hf(model.config)
    g = torch.Generator().manual_seed(3)
    keys = ("exp_avg", "exp_avg_sq") + (("main",) if main else ())
    hf = {key: {n: torch.randn(t.shape, generator=g) for n, t in model.state_dict().items()}
          for key in keys}
    shards = [[moments_from_hf(7.0, hf, arch, tp=2, tp_rank=r, pp=2, pp_rank=p)
               for r in range(2)] for p in range(2)]
    for p in range(2):
        for r in range(2):
            for key in keys:
                want = hf_to_megatron(hf[key], arch, tp=2, tp_rank=r, pp=2, pp_rank=p)
                got = shards[p][r]
                assert got.keys() == want.keys()
                assert all(torch.equal(got[n][key], want[n]) for n in want), (p, r, key)
                # the step as torch's Adam keeps it: a float32 scalar tensor
                assert all(got[n]["step"].dtype == torch.float32 and float(got[n]["step"]) == 7.0
                           for n in want)
    step, back = moments_to_hf(shards, arch)
    assert step == 7.0 and back.keys() == set(keys)
    for key in keys:
        assert back[key].keys() == hf[key].keys()
        assert all(torch.equal(back[key][n], hf[key][n]) for n in hf[key]), key
    bad = [[{**s, "decoder.final_layernorm.weight": {**s["decoder.final_layernorm.weight"],
                                                       "step": torch.tensor(8.0)}}
            if "decoder.final_layernorm.weight" in s else s for s in row] for row in shards]
    with pytest.raises(ValueError, match=r"at different steps \[7.0, 8.0\]"):
        moments_to_hf(bad, arch)


def test_arch_defaults_of_a_config_json():
    """A config.json (a dict) may leave out what transformers fills in: no
    num_key_value_heads is multi-head attention, no head_dim is hidden/heads, no
    tie_word_embeddings is untied, no rope_theta is 10000; a stated rms_norm_eps (Llama's
    1e-5) is read."""
    raw = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               intermediate_size=96, vocab_size=96, rms_norm_eps=1e-5)
    arch = ArchSpec.from_hf(raw)
    assert (arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings) == (4, 16, False)
    assert arch.rms_norm_eps == 1e-5 and arch.max_position_embeddings == 4096
    assert arch.rope_theta == 10000.0 and ArchSpec.from_hf({**raw, "rope_theta": 5e5}) \
        .rope_theta == 5e5
    arch.check_parallel(4, 1)                 # 4 kv heads over tp=4
    assert ArchSpec.from_hf({**raw, "head_dim": 8}).head_dim == 8


def test_transformer_config_takes_the_arch():
    """megatron's TransformerConfig gets the model's RMSNorm eps (a different eps moves the
    log-probs by less than the CPU comparison's tolerance), its GQA groups and head dim, and
    variable_seq_lengths exactly at PP > 1 (stages exchange each micro-batch's shape)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from hacpo.models.megatron.build import Parallel, transformer_config

    arch = _arch(rms_norm_eps=1e-5, head_dim=4)
    for pp in (1, 2):
        par = Parallel(tp=1, pp=pp, dp=1, tp_rank=0, pp_rank=0, dp_rank=0)
        cfg = transformer_config(arch, par)
        assert (cfg.layernorm_epsilon, cfg.num_query_groups, cfg.kv_channels) == (1e-5, 2, 4)
        assert not cfg.add_qkv_bias and not cfg.qk_layernorm
        assert cfg.variable_seq_lengths == (pp > 1)
    assert transformer_config(_arch(rms_norm_eps=3e-6), par).layernorm_epsilon == 3e-6
    # Qwen3's q/k norms: megatron sums their gradients over TP only when the config says so
    qwen3 = transformer_config(_arch(model_type="qwen3", head_dim=4), par)
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias
    assert transformer_config(_arch(model_type="qwen2"), par).add_qkv_bias


def test_check_megatron_policy_counts_the_layers_of_a_stage():
    """Full recomputation in chunks of recompute_num_layers must divide a *stage's* layers
    (4 layers at PP=2: 2 a stage), not the model's; the agent's vocabulary padding applies."""
    from types import SimpleNamespace

    from hacpo.engine.run_config import ParallelConfig
    from hacpo.models.megatron.build import check_megatron_policy

    pol = SimpleNamespace(model=tiny_hf("llama", layers=4), name="a",
                          tokenizer=SimpleNamespace(name="char"))
    par = ParallelConfig(pp=2, recompute="full", recompute_num_layers=2,
                         make_vocab_size_divisible_by=8)
    arch = check_megatron_policy(pol, par)
    assert (arch.num_layers, arch.make_vocab_size_divisible_by) == (4, 8)
    with pytest.raises(ValueError, match=r"agent 'a' \(trainer=megatron, tokenizer 'char'\): "
                                         r"recompute_num_layers=4 does not divide a pipeline "
                                         r"stage's 2 layer\(s\)"):
        check_megatron_policy(pol, ParallelConfig(pp=2, recompute="full",
                                                  recompute_num_layers=4))
    # the vocabulary padding is the agent's: 96 ids padded to 2*128 = 256 leave TP rank 1 none
    with pytest.raises(ValueError, match=r"agent 'a' .*vocab_size=96 padded to 256 .*rank 1 "):
        check_megatron_policy(pol, ParallelConfig(tp=2, make_vocab_size_divisible_by=128))


def test_built_model_has_the_padded_vocabulary():
    """build_gpt_model makes Vp rows (V=91 padded to 96 by make_vocab_size_divisible_by=8, even
    at TP=1), so the converted shard loads strictly; an untied model has its own output layer,
    a tied one none."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from tests.megatron._cpu_megatron import run_single

    def body(rank, world):
        from hacpo.models.megatron import build_gpt_model, init_parallel

        par = init_parallel(1, 1)
        for tie in (False, True):
            model = tiny_hf("qwen2", tie=tie, vocab=91)
            arch = ArchSpec.from_hf(model.config, make_vocab_size_divisible_by=8)
            gpt = build_gpt_model(arch, par)
            names = dict(gpt.named_parameters())
            assert names["embedding.word_embeddings.weight"].shape == (96, 64)
            assert ("output_layer.weight" in names) == (not tie)
            load_megatron_state(gpt, hf_to_megatron(hf_state_dict(model), arch))

    run_single(body)
