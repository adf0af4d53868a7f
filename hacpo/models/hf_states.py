"""Prompt states for Hugging Face causal LMs: forward P prompts once, score many responses on them.

The transformers counterpart of :meth:`hacpo.models.decoder.Decoder.encode_prefix` /
``hidden_continued``, in terms of the model's own key/value cache (transformers 5.x Cache API):

- :func:`encode_prefix` runs the base model over right-padded prompts ``[P, Lp]`` (positions =
  token index, ``use_cache=True``) and keeps each layer's cached keys and values
  ``[P, kv_heads, Lp, head_dim]`` (positional encoding applied, before any GQA repeat) and the
  final-norm hidden state of each prompt's last real token, as a
  :class:`~hacpo.models.decoder.PrefixStates`.
- :func:`hidden_continued` picks each row's prompt keys/values (``index_select``: gradients flow
  back into the states, which may be detached leaves), wraps them in a fresh
  :class:`~transformers.DynamicCache` for this call (the states' tensors are never written) and
  runs the base model on the right-padded responses ``[N, Lr]`` with the 2-D attention mask
  ``[prompt mask | response mask]`` and positions ``len(prompt) + j``. Prompt padding leaves
  holes in the keys, which the mask hides; every query sees its prompt's real tokens (>= 1), so
  no attention row is fully masked.

Supported: architectures whose every layer is full causal self-attention over the cache
(:func:`prompt_states_unsupported` says why a model is not), tested on llama, qwen2 and gpt2.
"""

from __future__ import annotations

import torch
from torch import nn

from hacpo.models.decoder import PrefixStates

# Architectures whose cache layout and masking are tested (tests/models/test_hf_prompt_states.py).
TESTED_MODEL_TYPES = ("llama", "qwen2", "gpt2")


def prompt_states_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers ``*ForCausalLM``) cannot use prompt states, or None."""
    cfg = model.config
    if cfg.model_type not in TESTED_MODEL_TYPES:
        return f"architecture {cfg.model_type!r} is not one of {list(TESTED_MODEL_TYPES)}"
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        # flash-attention kernels unpad by the 2-D mask and assume no holes inside a row
        return f"attention implementation {impl!r} (prompt states need 'sdpa' or 'eager')"
    if getattr(cfg, "add_cross_attention", False):
        return "cross-attention layers (encoder-decoder cache)"
    # a sliding window counts cache slots, which prompt padding holes would shift
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = ["full_attention" if getattr(cfg, "sliding_window", None) is None
                 else "sliding_attention"]
    if any(t != "full_attention" for t in types):
        return f"not every layer is full attention (layer types {sorted(set(types))})"
    return None


def _layers(cache) -> list:
    from transformers import DynamicCache

    if not isinstance(cache, DynamicCache):
        raise TypeError(f"expected the model to return a DynamicCache, got {type(cache).__name__}")
    return cache.layers


def encode_prefix(model: nn.Module, prefix_ids: torch.Tensor,
                  prefix_mask: torch.Tensor) -> PrefixStates:
    """prefix_ids, prefix_mask [P, Lp] (right-padded, >= 1 real token per row) ->
    :class:`PrefixStates` (kv per layer [P, kv_heads, Lp, head_dim], last [P, D]),
    differentiable w.r.t. the model's parameters."""
    P, Lp = prefix_ids.shape
    dev = prefix_ids.device
    prefix_mask = prefix_mask.bool()
    lengths = prefix_mask.long().sum(-1)                                      # [P]
    pos = torch.arange(Lp, device=dev).expand(P, Lp)
    out = model.base_model(input_ids=prefix_ids, attention_mask=prefix_mask.long(),
                           position_ids=pos, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in _layers(out.past_key_values)]
    last = out.last_hidden_state[torch.arange(P, device=dev), lengths - 1]   # [P, D]
    return PrefixStates(kv, last, prefix_mask, lengths)


def hidden_continued(model: nn.Module, states: PrefixStates, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, prefix_of_row: torch.Tensor, *,
                     max_positions: int) -> torch.Tensor:
    """Continuations input_ids, attention_mask [N, Lr] (right-padded) of the prefixes
    ``prefix_of_row [N]`` (long) -> final-norm hidden states [N, Lr, D], equal (up to float
    rounding) to the model's hidden states on each concatenation prefix + row.

    The caller checks that every prefix + real continuation fits ``max_positions`` (the
    model's position table); padding slots past it get the last position (their outputs are
    ignored and their keys masked), so a short row next to a long one is no error."""
    from transformers import DynamicCache

    N, Lr = input_ids.shape
    dev = input_ids.device
    # a fresh cache per call over row-selected copies: the forward appends the responses'
    # keys/values to it (new tensors by concatenation), never to the states
    cache = DynamicCache([(k.index_select(0, prefix_of_row), v.index_select(0, prefix_of_row))
                          for k, v in states.kv])
    pos = states.lengths.index_select(0, prefix_of_row)[:, None] + torch.arange(Lr, device=dev)
    pos = pos.clamp(max=max_positions - 1)
    mask = torch.cat([states.mask.index_select(0, prefix_of_row), attention_mask.bool()], dim=1)
    out = model.base_model(input_ids=input_ids, attention_mask=mask.long(), position_ids=pos,
                           past_key_values=cache, use_cache=True)
    return out.last_hidden_state
