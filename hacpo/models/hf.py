"""Hugging Face causal LMs: tiny random ones from a config dict, or local checkpoints.

``build_hf_model({"arch": "llama", "hidden_size": 64, ...}, vocab_size=...)`` builds a randomly
initialized model of a supported architecture (``"llama"``, ``"qwen2"``, ``"gpt2"``);
``load_hf_model(path)`` loads a local directory with ``local_files_only=True`` (no hub).
Models are returned in eval mode (dropout off): RL log-probs must not be random.
Nothing here touches the network.
"""

from __future__ import annotations

import os

import torch

# Small defaults for each architecture; any key of the transformers config can be overridden.
TINY_DEFAULTS = {
    "llama": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True),
    "qwen2": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
}


def _config_class(arch: str):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gpt2": GPT2Config}
    if arch not in classes:
        raise ValueError(f"unknown HF architecture {arch!r}; supported: {sorted(classes)}")
    return classes[arch]


def build_hf_model(config: dict, *, vocab_size: int, pad_id: int | None = None,
                   eos_id: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Random-init causal LM. ``config`` holds ``arch`` plus transformers config overrides."""
    from transformers import AutoModelForCausalLM

    config = dict(config)
    arch = config.pop("arch", "llama")
    kwargs = {**TINY_DEFAULTS.get(arch, {}), **config, "vocab_size": vocab_size}
    if pad_id is not None:
        kwargs["pad_token_id"] = pad_id
    if eos_id is not None:
        kwargs["eos_token_id"] = eos_id
        kwargs["bos_token_id"] = kwargs.get("bos_token_id", eos_id)
    cfg = _config_class(arch)(**kwargs)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).eval()  # RL log-probs must be deterministic: no dropout


def load_hf_model(path: str, *, dtype: torch.dtype = torch.float32):
    """Load a local checkpoint directory (``config.json`` + weights); never downloads."""
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no HF model at {path!r}: expected a local directory with "
                                f"config.json and weights (hub downloads are disabled)")
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()
