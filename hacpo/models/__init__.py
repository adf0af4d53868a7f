"""Policies, tokenizers, sampling and re-tokenization for heterogeneous agents.

Importing this package imports torch only; transformers is imported when an HF tokenizer or
model is first built.
"""

from hacpo.models.generation import Rollout, generate, sample_next
from hacpo.models.policy import Policy, PolicyConfig, build_policy, token_logprobs
from hacpo.models.retokenize import RetokStats, RetokStatus, retokenize
from hacpo.models.tokenizer import (CharTokenizer, HFTokenizer, Tokenizer, UnencodableTextError,
                                    load_tokenizer)

__all__ = ["Rollout", "generate", "sample_next", "Policy", "PolicyConfig", "build_policy",
           "token_logprobs", "RetokStats", "RetokStatus", "retokenize", "CharTokenizer",
           "HFTokenizer", "Tokenizer", "UnencodableTextError", "load_tokenizer"]
