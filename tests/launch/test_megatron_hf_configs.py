"""Hugging Face configs as real checkpoints write them, beyond the tiny ones of tests/megatron:
the megatron policy either matches the HF model (per-token log-probs within 1e-5 in fp32, at
TP=1 and TP=2, and the weights back exactly) or refuses the config with an error that names
the feature it lacks, before any weight is loaded; never silently different numbers.

Matched: grouped-query attention with 1 kv head and with as many kv heads as query heads, an
explicit ``head_dim`` other than hidden/heads (Llama; Qwen3 with a hidden size heads do not
divide), rope_theta 5e5, a large rms_norm_eps, odd vocabularies, tied and untied embeddings,
and a Qwen2 config whose ``sliding_window`` is set but turned off (``use_sliding_window=False``,
as in Qwen2.5's config.json). Refused: Qwen3's ``attention_bias`` (q/k/v *and* o_proj biases)
and Qwen2 / Qwen3 sliding-window attention, which megatron ran as full attention before
(log-probs off by ~0.7-2.5 nats on these tiny models), and the Llama biases and RoPE scalings
already refused.
"""
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from hacpo.models.megatron import ArchSpec, MegatronPolicy  # noqa: E402
from tests.megatron._cpu_megatron import run_single, spawn  # noqa: E402
from tests.megatron._workers import batch, hf_logprobs  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
            tie_word_embeddings=False, rms_norm_eps=1e-6)


def _config(arch: str, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](
        **{**BASE, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def tiny(arch: str, seed: int = 0, **kw):
    """A random tiny HF model of ``BASE`` + ``kw``, scaled as tests/megatron/_workers.tiny_hf's
    (log-probs spread by ~1 nat, norm weights away from 1, biases non-zero)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(arch, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.float().eval()


# -- refused ------------------------------------------------------------------------------------
SLIDING = "sliding-window attention .* is not supported"
UNSUPPORTED = [
    ("qwen3", dict(attention_bias=True), "qwen3 with attention_bias=True"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), SLIDING),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), SLIDING),
    # a window longer than these sequences still slides over longer ones
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), SLIDING),
    ("llama", dict(attention_bias=True), "attention_bias/mlp_bias"),
    ("llama", dict(mlp_bias=True), "attention_bias/mlp_bias"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "only plain RoPE"),
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}), "only plain RoPE"),
]


@pytest.mark.parametrize("arch,kw,msg", UNSUPPORTED,
                         ids=[f"{a}-{'-'.join(k)}" for a, k, _ in UNSUPPORTED])
def test_unsupported_features_are_clear_errors(arch, kw, msg):
    model = tiny(arch, **kw)
    with pytest.raises(ValueError, match=msg):
        ArchSpec.from_hf(model.config)
    with pytest.raises(ValueError, match=msg):    # the policy refuses before any megatron call
        MegatronPolicy.from_hf(model, par=None)


def test_sliding_window_in_config_dicts():
    """A transformers-4 config.json dict (no ``layer_types``): the layers from
    ``max_window_layers`` on slide when ``use_sliding_window`` is on, as transformers does."""
    raw = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 96, "sliding_window": 4}
    for ok in (dict(use_sliding_window=False, max_window_layers=0),   # Qwen2.5's config.json
               dict(use_sliding_window=True, max_window_layers=4)):   # no layer slides
        ArchSpec.from_hf({**raw, **ok})
    with pytest.raises(ValueError, match=r"layer types \['full_attention', "
                                         r"'sliding_attention'\]"):
        ArchSpec.from_hf({**raw, "use_sliding_window": True, "max_window_layers": 2})


def test_sliding_window_agent_is_config_error():
    """A megatron agent whose qwen2 policy has sliding-window layers: a config error before
    anything starts (the rollout's HF model would slide, the megatron trainer would not)."""
    from .test_megatron_trainer import HF, megatron_cfg

    cfg = megatron_cfg(Path("/nonexistent"), "sw", "megatron")
    cfg.override({"agents.0.policy.arch": "qwen2"})                    # full attention: fine
    with pytest.raises(ValueError, match=r"agent 'llama-tp2' \(trainer=megatron\): "
                                         r"sliding-window attention"):
        cfg.override({"agents.0.policy.arch": "qwen2", "agents.0.policy.hf_config": {
            **HF, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}})


# -- matched ------------------------------------------------------------------------------------
SUPPORTED = {
    "llama-tied-kv1": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama-kv4-hd32-theta5e5": ("llama", dict(num_key_value_heads=4, head_dim=32,
                                              rope_theta=5e5)),
    "qwen2-tied-kv4-v91-sw-off": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=4,
                                                vocab_size=91, use_sliding_window=False,
                                                sliding_window=4, max_window_layers=0)),
    "qwen3-h60-hd8-eps0.5-v97": ("qwen3", dict(hidden_size=60, head_dim=8, rms_norm_eps=0.5,
                                               vocab_size=97)),
}


def logprobs_worker(rank, world, tp, names, out_path):
    """For each SUPPORTED case: log-probs of both lm heads, the HF model's, and whether the
    weights gathered back equal the HF ones. Rank 0 saves {name: (fused, logits, hf, same)}."""
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron import hf_state_dict, init_parallel

    res = {}
    for name in names:
        arch, kw = SUPPORTED[name]
        hf = tiny(arch, **kw)
        ids, targets = batch(hf.config.vocab_size)
        par = init_parallel(tp, 1)
        lps = [MegatronPolicy.from_hf(hf, par, lm_head=head).token_logprobs(ids, targets)
               for head in ("fused", "logits")]
        back = MegatronPolicy.from_hf(hf, par).hf_state_dict()
        ref = hf_state_dict(hf)
        same = back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
        res[name] = (*lps, hf_logprobs(hf, ids, targets), same)
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save(res, out_path)


def _check(res):
    for name, (fused, logits, ref, same) in res.items():
        assert same, f"{name}: weights gathered back from megatron differ from the HF ones"
        assert ref.std() > 0.3, f"{name}: log-probs too flat for the tolerance to bite"
        # fp32 with another op order: seen <= 2e-6 (tests/megatron/test_megatron_policy.py)
        torch.testing.assert_close(fused, ref, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0, msg=name)


def test_tp1_matches_hf(tmp_path):
    run_single(logprobs_worker, 1, list(SUPPORTED), str(tmp_path / "tp1.pt"))
    _check(torch.load(tmp_path / "tp1.pt"))


@pytest.mark.multiprocess
def test_tp2_matches_hf(tmp_path):
    names = [n for n in SUPPORTED if "kv1" not in n]      # one kv head does not split
    spawn(logprobs_worker, 2, 2, names, str(tmp_path / "tp2.pt"))
    _check(torch.load(tmp_path / "tp2.pt"))
