"""megatron-core TP/PP/DP policies built from Hugging Face Llama / Qwen2 / Qwen3 models.

- :mod:`~hacpo.models.megatron.build`: ``ArchSpec`` (from an HF config), ``init_parallel``,
  ``build_gpt_model`` (megatron-core ``GPTModel``, local or Transformer Engine layer spec);
- :mod:`~hacpo.models.megatron.convert`: HF <-> megatron weight mapping (TP shards, PP stages);
- :mod:`~hacpo.models.megatron.policy`: ``MegatronPolicy`` (vocab-parallel token log-probs
  of the positions asked for, through ``hacpo.kernels.fused_linear_token_logprobs`` on the
  final hidden states or ``token_logprobs`` on megatron's logits; megatron optimizer step).

Importing this package does not import megatron-core (it is imported by the functions that
build models or optimizers); ``hacpo.models`` does not import this package at all.
"""
from hacpo.models.megatron.build import (ArchSpec, Parallel, build_gpt_model, check_world,
                                         init_parallel, require_megatron)
from hacpo.models.megatron.convert import (hf_state_dict, hf_to_megatron, hf_units,
                                           iter_hf_weights, load_megatron_state, megatron_to_hf,
                                           plan_buckets, unit_of_hf_name)
from hacpo.models.megatron.policy import MegatronPolicy

__all__ = ["ArchSpec", "Parallel", "build_gpt_model", "check_world", "init_parallel",
           "require_megatron", "hf_state_dict", "hf_to_megatron", "hf_units", "iter_hf_weights",
           "load_megatron_state", "megatron_to_hf", "plan_buckets", "unit_of_hf_name",
           "MegatronPolicy"]
