"""Weight-mapping layouts that no round trip and no CPU log-prob comparison can see, checked
against megatron-core's own statement of them (found by a mutation audit: a mistake made the
same way in both directions of the conversion survived every other test).

``transformer_impl="transformer_engine"`` cannot run here (transformer-engine needs CUDA), so a
swapped pair of fused-norm names would convert back exactly and fail only on a GPU cluster
(each layer's pre-attention RMSNorm weight multiplied into the MLP input and vice versa).
megatron-core's *local* layer spec says how its names map onto transformer-engine's fused ones
(``sharded_state_dict_keys_map``, used by megatron's own checkpoints to move between the two):
the transformer-engine shard must be the local shard renamed by exactly that map.

Also: which layers of a transformers-4 style Qwen2 / Qwen3 ``config.json`` slide (megatron
here has full attention only, so a sliding layer must be refused), decided as transformers
decides it (its config's ``layer_types``), at every ``max_window_layers``."""
import pytest
import torch

from hacpo.models.megatron.build import ArchSpec
from hacpo.models.megatron.convert import hf_state_dict, hf_to_megatron
from tests.megatron._workers import ARCHS, tiny_hf


def _megatron_keys_map(qk_norm: bool) -> dict[str, str]:
    """megatron-core's local-name prefix -> transformer-engine-name prefix of a GPT layer."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                        "-c requirements/constraints.txt megatron-core==0.16.1)")
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm,
                                                    normalization="RMSNorm")
    keys_map = dict(spec.submodules.sharded_state_dict_keys_map)
    assert keys_map, "megatron-core's local spec no longer states its transformer-engine names"
    return keys_map


def _renamed(name: str, keys_map: dict[str, str]) -> str:
    """``decoder.layers.{i}.{local name}`` -> the transformer-engine name by ``keys_map``."""
    head, sep, rest = name.partition("decoder.layers.")
    if not sep:
        return name
    layer, _, sub = rest.partition(".")
    for src, dst in keys_map.items():
        if sub.startswith(src):
            sub = dst + sub[len(src):]
    return f"{head}decoder.layers.{layer}.{sub}"


@pytest.mark.parametrize("arch_name", ARCHS)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_transformer_engine_names_are_megatrons_renaming(arch_name, tp, pp):
    model = tiny_hf(arch_name, tie=False)
    arch = ArchSpec.from_hf(model.config)
    sd = hf_state_dict(model)
    keys_map = _megatron_keys_map(arch.qk_norm)
    for p in range(pp):
        for r in range(tp):
            local = hf_to_megatron(sd, arch, tp=tp, tp_rank=r, pp=pp, pp_rank=p)
            te = hf_to_megatron(sd, arch, tp=tp, tp_rank=r, pp=pp, pp_rank=p,
                                transformer_impl="transformer_engine")
            expect = {_renamed(n, keys_map): t for n, t in local.items()}
            assert te.keys() == expect.keys(), sorted(te.keys() ^ expect.keys())
            for n, t in expect.items():
                assert torch.equal(te[n], t), n
            # the norms do differ (the test model's norm weights are random): a swap shows
            a, b = (f"decoder.layers.0.{dst}weight" for dst in keys_map.values())
            assert not torch.equal(te[a], te[b])


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("use_sliding_window", [True, False])
@pytest.mark.parametrize("max_window_layers", [0, 1, 3, 4, 5, None])
def test_sliding_layers_are_transformers_own(model_type, use_sliding_window,
                                             max_window_layers):
    """A config dict without ``layer_types`` (as transformers 4 wrote config.json): refused
    exactly when transformers' own config gives a layer sliding-window attention (layers
    ``max_window_layers`` .. L-1 slide when ``use_sliding_window``; None: the key missing, so
    transformers' default of 28 applies and none of the 4 layers slides)."""
    from transformers import Qwen2Config, Qwen3Config

    raw = {"model_type": model_type, "num_hidden_layers": 4, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 96, "sliding_window": 4, "use_sliding_window": use_sliding_window}
    if max_window_layers is not None:
        raw["max_window_layers"] = max_window_layers
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    kw = {k: v for k, v in raw.items() if k != "model_type"}
    slides = any(t != "full_attention" for t in cls(**kw).layer_types)
    first = 28 if max_window_layers is None else max_window_layers
    assert slides == (use_sliding_window and first < 4)    # the rule, as stated
    if slides:
        with pytest.raises(ValueError, match="sliding-window attention"):
            ArchSpec.from_hf(raw)
    else:
        assert ArchSpec.from_hf(raw).num_layers == 4
