"""Hugging Face causal LMs: tiny random ones from a config dict, or local checkpoints.

``build_hf_model({"arch": "llama", "hidden_size": 64, ...}, vocab_size=...)`` builds a randomly
initialized model of a supported architecture (``"llama"``, ``"qwen2"``, ``"gpt2"``);
``load_hf_model(path)`` loads a local directory with ``local_files_only=True`` (no hub).
Models are returned in eval mode (dropout off): RL log-probs must not be random.
Nothing here touches the network.
"""

from __future__ import annotations

import copy
import os
import re

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


def _require_transformers() -> None:
    from hacpo.engine.errors import require
    require("transformers", "a Hugging Face policy (policy.kind=hf)")


def _config_class(arch: str):
    _require_transformers()
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gpt2": GPT2Config}
    if arch not in classes:
        raise ValueError(f"unknown HF architecture {arch!r}; supported: {sorted(classes)}")
    return classes[arch]


def check_hf_config(arch: str, overrides: dict) -> None:
    """A ValueError if ``overrides`` (config keys, without ``arch``) holds a key that is no field
    of ``arch``'s transformers config: transformers keeps such a key as an extra attribute and
    builds the default model, so a misspelt override ("hiden_size") would be silently ignored.
    Keys the config consumes (e.g. rope_theta, folded into rope_parameters) are fields."""
    cls = _config_class(arch)
    known = set(cls().to_dict()) | set(cls.attribute_map)
    extra = cls(**copy.deepcopy({k: v for k, v in overrides.items() if k not in known})).to_dict()
    unknown = sorted(k for k in overrides if k not in known and k in extra)
    if unknown:
        raise ValueError(f"HF {arch} config: unknown key(s) {unknown} (not fields of "
                         f"{cls.__name__}; a misspelling would build the default model)")


def build_hf_model(config: dict, *, vocab_size: int, pad_id: int | None = None,
                   eos_id: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Random-init causal LM. ``config`` holds ``arch`` plus transformers config overrides."""
    _require_transformers()
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(dict(config))    # transformers edits nested dicts (rope_scaling)
    arch = config.pop("arch", "llama")
    kwargs = {**TINY_DEFAULTS.get(arch, {}), **config, "vocab_size": vocab_size}
    if pad_id is not None:
        kwargs["pad_token_id"] = pad_id
    if eos_id is not None:
        kwargs["eos_token_id"] = eos_id
        kwargs["bos_token_id"] = kwargs.get("bos_token_id", eos_id)
    check_hf_config(arch, config)
    cfg = _config_class(arch)(**kwargs)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).eval()  # RL log-probs must be deterministic: no dropout


# the weight files transformers reads (not e.g. a Trainer folder's training_args.bin)
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)")


def _unreadable_weight_files(path: str) -> list[str]:
    """The weight files in ``path`` that cannot be opened as such."""
    from safetensors import safe_open

    bad = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not _WEIGHT_FILE.fullmatch(name):
            continue
        try:
            if name.endswith(".safetensors"):
                with safe_open(full, framework="pt"):   # checks the header covers the file
                    pass
            else:
                torch.load(full, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            bad.append(name)
    return bad


def load_hf_model(path: str, *, dtype: torch.dtype = torch.float32):
    """Load a local checkpoint directory (``config.json`` + weights); never downloads."""
    _require_transformers()
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no HF model at {path!r}: expected a local directory with "
                                f"config.json and weights (hub downloads are disabled)")
    try:
        # ignore_mismatched_sizes: a weight of another shape than config.json's is reported
        # below by name (transformers 5 raises a RuntimeError pointing at its logged report)
        model, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                           dtype=dtype, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
    except Exception as e:
        # a damaged weight file fails inside safetensors / torch.load with a message naming no
        # file ("header too small", "[Errno 22] Invalid argument", a bare EOFError) and, for
        # safetensors, an error type the command line does not report as the user's
        bad = [] if isinstance(e, ImportError) else _unreadable_weight_files(path)
        if not bad:
            raise                # transformers' own (no weights, a missing shard, model_type)
        raise ValueError(f"HF checkpoint {path!r}: weight file(s) {bad} cannot be read "
                         f"(damaged or incomplete?): {type(e).__name__}: {e}") from e
    # transformers fills weights the checkpoint lacks (or holds in another shape) with random
    # ones and only logs it: a policy must start from the weights it was given
    bad = {k: sorted(x if isinstance(x, str) else
                     f"{x[0]} (checkpoint {list(x[1])}, config {list(x[2])})"
                     for x in info.get(k) or ()) for k in ("missing_keys", "mismatched_keys")}
    if any(bad.values()):
        raise ValueError(f"HF checkpoint {path!r} does not hold all of "
                         f"{type(model).__name__}'s weights (they would be random): "
                         + "; ".join(f"{k.replace('_', ' ')}: {v[:8]}"
                                     + (f" and {len(v) - 8} more" if len(v) > 8 else "")
                                     for k, v in bad.items() if v))
    return model.eval()
