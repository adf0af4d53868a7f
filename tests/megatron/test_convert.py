"""HF <-> megatron weight mapping (pure tensors: needs transformers, not megatron-core) and the
configuration errors. Runs in a few seconds."""
import subprocess
import sys

import pytest
import torch

from hacpo.models.megatron.build import ArchSpec, check_world, resolve_transformer_impl
from hacpo.models.megatron.convert import (fuse_qkv, hf_state_dict, hf_to_megatron, hf_units,
                                           megatron_to_hf, plan_buckets, unit_megatron_names,
                                           unit_of_hf_name, unit_stage, unit_to_hf)
from tests.megatron._workers import ARCHS, tiny_hf


def _shards(sd, arch, tp, pp, impl="local"):
    return [[hf_to_megatron(sd, arch, tp=tp, tp_rank=r, pp=pp, pp_rank=p, transformer_impl=impl)
             for r in range(tp)] for p in range(pp)]


@pytest.mark.parametrize("arch_name", ARCHS)
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_roundtrip_exact(arch_name, tie, tp, pp):
    model = tiny_hf(arch_name, tie=tie)
    arch = ArchSpec.from_hf(model.config)
    sd = hf_state_dict(model)
    back = megatron_to_hf(_shards(sd, arch, tp, pp), arch)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp,pp,multiple,vp", [(2, 1, 1, 92), (2, 2, 1, 92), (1, 2, 1, 91),
                                               (2, 1, 8, 96), (1, 1, 8, 96)])
def test_odd_vocab_padded_and_stripped(tie, tp, pp, multiple, vp):
    """V=91: the megatron vocabulary rows are padded with zeros to Vp (the smallest multiple
    of tp * make_vocab_size_divisible_by), each rank holding Vp/tp rows, the real ones equal to
    the HF rows; megatron_to_hf strips them (exact round trip, HF names and shapes)."""
    model = tiny_hf("qwen2", tie=tie, vocab=91)
    arch = ArchSpec.from_hf(model.config, make_vocab_size_divisible_by=multiple)
    assert arch.padded_vocab_size(tp) == vp
    sd = hf_state_dict(model)
    shards = _shards(sd, arch, tp, pp)
    rows = vp // tp
    for name, hf_name, stage in [("embedding.word_embeddings.weight", "model.embed_tokens.weight",
                                  0),
                                 ("output_layer.weight", "model.embed_tokens.weight" if tie
                                  else "lm_head.weight", pp - 1)]:
        if name == "output_layer.weight" and tie and pp == 1:
            assert all(name not in sh for sh in shards[stage])
            continue
        for r in range(tp):
            t, n = shards[stage][r][name], arch.real_vocab_of_rank(tp, r)
            assert t.shape == (rows, 64) and n == min(rows, 91 - r * rows) > 0
            assert torch.equal(t[:n], sd[hf_name][r * rows:r * rows + n]), (name, r)
            assert not t[n:].any(), (name, r)
    back = megatron_to_hf(shards, arch)
    assert back.keys() == sd.keys()
    for k in sd:
        assert back[k].shape == sd[k].shape and torch.equal(back[k], sd[k]), k
    # shards of another padding are refused, naming the sizes
    other = ArchSpec.from_hf(model.config, make_vocab_size_divisible_by=64)   # Vp=128
    with pytest.raises(ValueError, match=rf"embedding.word_embeddings.weight: {vp} rows over "
                                         rf"tp={tp}, expected the padded vocabulary Vp="
                                         rf"{other.padded_vocab_size(tp)} \(vocab_size=91\)"):
        megatron_to_hf(shards, other)


@pytest.mark.parametrize("arch_name", ARCHS)
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 4), (2, 2)])
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_units_partition_the_model(arch_name, tie, tp, pp, impl):
    """A weight stream converts unit by unit: the units' megatron names partition every
    stage's shard (a tied model's last-stage output copy is the one name left out), each unit
    converted on its own gives exactly the HF weights of that unit (unit_of_hf_name), and all
    units together are the exact HF state dict."""
    model = tiny_hf(arch_name, tie=tie, layers=4)
    arch = ArchSpec.from_hf(model.config)
    sd = hf_state_dict(model)
    shards = _shards(sd, arch, tp, pp, impl)
    units = hf_units(arch)
    assert units == [("embed", 0), *[("layer", i) for i in range(4)], ("final", 0)]
    for stage in range(pp):
        names = list(shards[stage][0])
        owned = [n for u in units if unit_stage(u, arch, pp) == stage
                 for n in unit_megatron_names(u, names, arch, pp)]
        left = set(names) - set(owned)
        assert len(owned) == len(set(owned))
        assert left == ({"output_layer.weight"} if tie and pp > 1 and stage == pp - 1
                        else set()), (stage, left)
    got = {}
    for u in units:
        st = unit_stage(u, arch, pp)
        parts = [{n: sh[n] for n in unit_megatron_names(u, list(sh), arch, pp)}
                 for sh in shards[st]]
        pairs = list(unit_to_hf(u, parts, arch, pp=pp, transformer_impl=impl))
        assert pairs and all(unit_of_hf_name(n) == u for n, _ in pairs), u
        got.update(pairs)
    assert got.keys() == sd.keys()
    order = [units.index(unit_of_hf_name(n)) for n in got]
    assert order == sorted(order)                      # unit by unit, in HF order
    for k in sd:
        assert torch.equal(got[k], sd[k]), k
    with pytest.raises(ValueError, match=r"no unit \('layer', 4\) in a model of 4 layers"):
        unit_stage(("layer", 4), arch, pp)
    with pytest.raises(ValueError, match=r"'model.rotary.inv_freq' is not a Llama"):
        unit_of_hf_name("model.rotary.inv_freq")


def test_plan_buckets():
    """Consecutive units, at most bucket_bytes each (a bigger unit alone), none lost."""
    sizes = [(("embed", 0), 50), (("layer", 0), 20), (("layer", 1), 20), (("layer", 2), 20),
             (("layer", 3), 70), (("final", 0), 10)]
    assert plan_buckets(sizes, 40) == [[("embed", 0)], [("layer", 0), ("layer", 1)],
                                       [("layer", 2)], [("layer", 3)], [("final", 0)]]
    assert plan_buckets(sizes, 60) == [[("embed", 0)], [("layer", 0), ("layer", 1),
                                                        ("layer", 2)], [("layer", 3)],
                                       [("final", 0)]]
    assert plan_buckets(sizes, 1000) == [[u for u, _ in sizes]]
    assert plan_buckets(sizes, 1) == [[u] for u, _ in sizes]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        plan_buckets(sizes, 0)


def test_vocab_rows_must_match_the_config():
    arch = ArchSpec.from_hf(tiny_hf("llama").config)
    sd = hf_state_dict(tiny_hf("llama", vocab=91))
    with pytest.raises(ValueError, match="vocabulary weight has 91 rows, the config's "
                                         "vocab_size is 96"):
        hf_to_megatron(sd, arch, tp=2)


@pytest.mark.parametrize("arch_name", ARCHS)
def test_hf_weights_must_all_map(arch_name):
    """A weight the conversion does not know (a feature megatron would silently lack: before,
    it was dropped) and a missing one are errors naming them; a tied model may carry its
    lm_head.weight (HF's state_dict lists it)."""
    model = tiny_hf(arch_name, tie=True)
    arch = ArchSpec.from_hf(model.config)
    sd = hf_state_dict(model)
    hf_to_megatron({**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}, arch)
    extra = {**sd, "model.layers.1.self_attn.o_proj.bias": torch.zeros(arch.hidden_size)}
    with pytest.raises(ValueError, match=rf"the HF weights do not fit the megatron {arch_name} "
                                         r"model of this config; not mapped to megatron \(an "
                                         r"unsupported feature\?\): model.layers.1.self_attn."
                                         r"o_proj.bias$"):
        hf_to_megatron(extra, arch, tp=2, tp_rank=1)
    short = {k: v for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"; missing: model.layers.0.mlp.up_proj.weight$"):
        hf_to_megatron(short, arch, pp=2, pp_rank=1)   # even on a stage without that layer


def test_roundtrip_transformer_engine_names():
    model = tiny_hf("qwen3", tie=False)
    arch = ArchSpec.from_hf(model.config)
    sd = hf_state_dict(model)
    shards = _shards(sd, arch, 2, 1, impl="transformer_engine")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shards[0][0]
    assert "decoder.layers.0.input_layernorm.weight" not in shards[0][0]
    back = megatron_to_hf(shards, arch, transformer_impl="transformer_engine")
    assert all(torch.equal(back[k], sd[k]) for k in sd) and back.keys() == sd.keys()


def test_shard_layout_is_megatrons():
    """The layouts a round trip cannot see (it would also pass for a consistently wrong one):
    fused QKV grouped by kv head and split by group over TP; fc1 = [gate_r; up_r] per rank;
    row-parallel splits along dim 1; PP stages renumber layers from 0; tied output at PP>1."""
    model = tiny_hf("qwen2", tie=True, layers=2)
    arch = ArchSpec.from_hf(model.config)   # 4 q heads, 2 kv heads, head_dim 16
    sd = hf_state_dict(model)
    a = "model.layers.1.self_attn."
    q, k, v = sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]
    d = 16
    # group 0 = q heads 0,1 then k head 0 then v head 0; TP rank 1 holds group 1
    r1 = hf_to_megatron(sd, arch, tp=2, tp_rank=1, pp=2, pp_rank=1)
    expect = torch.cat([q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_qkv.weight"], expect)
    assert torch.equal(fuse_qkv(q, k, v, arch)[4 * d:], expect)
    F = arch.ffn_hidden_size
    gate, up = sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(r1["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([gate[F // 2:], up[F // 2:]]))
    assert torch.equal(r1["decoder.layers.0.mlp.linear_fc2.weight"],
                       sd["model.layers.1.mlp.down_proj.weight"][:, F // 2:])
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_proj.weight"],
                       sd[a + "o_proj.weight"][:, 32:])
    emb = sd["model.embed_tokens.weight"]
    assert torch.equal(r1["output_layer.weight"], emb[emb.shape[0] // 2:])
    assert "embedding.word_embeddings.weight" not in r1
    assert not any(n.startswith("decoder.layers.1.") for n in r1)
    # at PP=1 a tied model has no separate output layer
    assert "output_layer.weight" not in hf_to_megatron(sd, arch, tp=2, tp_rank=0)


def _arch(**kw):
    base = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, vocab_size=96)
    return ArchSpec.from_hf({**base, **kw})


@pytest.mark.parametrize("kw,tp,pp,msg", [
    (dict(num_attention_heads=6, num_key_value_heads=6), 4, 1,
     "num_attention_heads=6 is not divisible by tensor-parallel size tp=4"),
    (dict(num_attention_heads=8, num_key_value_heads=2), 4, 1,
     "num_key_value_heads=2 is not divisible by tensor-parallel size tp=4"),
    # a vocabulary is padded (V=5 -> 8 at tp=4), but no shard may hold only padding
    (dict(vocab_size=5, num_key_value_heads=4), 4, 1,
     r"vocab_size=5 padded to 8 \(a multiple of tp\*make_vocab_size_divisible_by = 4\*1\) "
     r"gives tensor-parallel shards of 2 rows: rank 3 \(rows 6..7\) would hold only padding"),
    (dict(num_hidden_layers=3), 1, 2,
     "num_hidden_layers=3 is not divisible by pipeline-parallel size pp=2"),
])
def test_divisibility_errors_name_the_numbers(kw, tp, pp, msg):
    arch = _arch(**kw)
    with pytest.raises(ValueError, match=msg):
        arch.check_parallel(tp, pp)
    with pytest.raises(ValueError, match=msg):   # the converter checks too
        hf_to_megatron({}, arch, tp=tp, pp=pp)


def test_vocab_padding_layouts():
    assert _arch(vocab_size=97).padded_vocab_size(2) == 98
    _arch(vocab_size=97).check_parallel(2, 1)               # no longer an error
    _arch(vocab_size=7, num_key_value_heads=4).check_parallel(4, 1)   # 7 -> 8: 2,2,2,1 real
    assert [_arch(vocab_size=7).real_vocab_of_rank(4, r) for r in range(4)] == [2, 2, 2, 1]
    assert _arch(vocab_size=96).padded_vocab_size(2) == 96  # divisible: no padding
    big = ArchSpec.from_hf({**dict(model_type="llama", num_hidden_layers=2, hidden_size=64,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=60)},
                           make_vocab_size_divisible_by=64)
    assert big.padded_vocab_size(1) == 64
    with pytest.raises(ValueError, match=r"vocab_size=60 padded to 128 \(a multiple of "
                                         r"tp\*make_vocab_size_divisible_by = 2\*64\) gives "
                                         r"tensor-parallel shards of 64 rows: rank 1"):
        big.check_parallel(2, 1)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by must be an integer >= 1, "
                                         "got 0"):
        ArchSpec.from_hf(tiny_hf("llama").config, make_vocab_size_divisible_by=0)


def test_world_size_errors():
    assert check_world(2, 1, None, 4) == 2
    with pytest.raises(ValueError, match=r"tp\*pp\*dp = 2\*2\*2 = 8 does not match the world "
                                         r"size 4"):
        check_world(2, 2, 2, 4)
    with pytest.raises(ValueError, match="world size 3 is not divisible by tp\\*pp = 2\\*1"):
        check_world(2, 1, None, 3)


def test_arch_from_hf_reads_every_field():
    arch = ArchSpec.from_hf(tiny_hf("qwen3", tie=False).config)
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.ffn_hidden_size, arch.vocab_size) == (2, 64, 4, 2, 32, 96, 96)
    assert (arch.rope_theta, arch.rms_norm_eps, arch.tie_word_embeddings) == (1e6, 1e-6, False)
    assert arch.qk_norm and not arch.qkv_bias
    assert ArchSpec.from_hf(tiny_hf("qwen2").config).qkv_bias
    assert ArchSpec.from_hf(tiny_hf("llama").config).rope_theta == 1e4


def test_unsupported_configs():
    from transformers import LlamaConfig

    scaled = LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "original_max_position_embeddings": 8192,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    with pytest.raises(ValueError, match="only plain RoPE"):
        ArchSpec.from_hf(scaled)
    with pytest.raises(ValueError, match="unsupported HF model_type 'gpt2'"):
        ArchSpec.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="only SwiGLU"):
        _arch(hidden_act="gelu")


def test_transformer_engine_missing_is_an_error():
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    with pytest.raises(RuntimeError, match="transformer_engine is not importable"):
        resolve_transformer_impl("transformer_engine")
    with pytest.raises(ValueError, match="transformer_impl must be"):
        resolve_transformer_impl("apex")


def test_packages_do_not_import_megatron():
    code = ("import sys, hacpo.engine, hacpo.models, hacpo.models.megatron; "
            "print([m for m in sys.modules if m.split('.')[0] == 'megatron'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
