"""Bad parallel layouts not covered by test_convert.py: each is a ValueError naming the
offending numbers (pure Python, no megatron-core needed)."""
import pytest

from hacpo.models.megatron.build import ArchSpec, check_world
from hacpo.models.megatron.convert import hf_to_megatron, megatron_to_hf


def _arch(**kw):
    base = dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, vocab_size=96)
    return ArchSpec.from_hf({**base, **kw})


@pytest.mark.parametrize("kw,tp,msg", [
    (dict(intermediate_size=97), 2,
     "intermediate_size=97 is not divisible by tensor-parallel size tp=2"),
    (dict(num_attention_heads=6, num_key_value_heads=4), 1,
     "num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
])
def test_more_divisibility_errors(kw, tp, msg):
    arch = _arch(**kw)
    with pytest.raises(ValueError, match=msg):
        arch.check_parallel(tp, 1)
    with pytest.raises(ValueError, match=msg):
        hf_to_megatron({}, arch, tp=tp)


def test_valid_layouts_pass():
    arch = _arch()
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        arch.check_parallel(tp, pp)
    assert [list(arch.layers_of_stage(2, s)) for s in range(2)] == [[0], [1]]


@pytest.mark.parametrize("tp,pp,dp,world,msg", [
    (0, 1, None, 2, "tp must be >= 1, got 0"),
    (1, -1, None, 2, "pp must be >= 1, got -1"),
    (2, 2, None, 2, r"world size 2 is not divisible by tp\*pp = 2\*2"),
    (1, 2, 1, 4, r"tp\*pp\*dp = 1\*2\*1 = 2 does not match the world size 4"),
    (2, 2, 2, 4, r"tp\*pp\*dp = 2\*2\*2 = 8 does not match the world size 4"),
])
def test_world_errors(tp, pp, dp, world, msg):
    with pytest.raises(ValueError, match=msg):
        check_world(tp, pp, dp, world)


def test_world_ok():
    assert check_world(2, 2, None, 4) == 1
    assert check_world(1, 2, None, 4) == 2
    assert check_world(2, 1, 2, 4) == 2


def test_uneven_tp_shards_in_megatron_to_hf():
    arch = _arch()
    with pytest.raises(ValueError, match="every pipeline stage needs the same number of TP"):
        megatron_to_hf([[{}, {}], [{}]], arch)
