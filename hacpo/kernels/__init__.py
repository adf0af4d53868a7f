"""Fused log-prob kernels: token log-probs from logits or from (hidden, lm_head weight).

Importing this package imports torch only; triton is imported on first use of the triton backend.
"""
from hacpo.kernels.fused_linear import (fused_linear_token_logprobs,
                                        fused_linear_token_logprobs_reference)
from hacpo.kernels.logprobs import (sequence_mean_logprobs, sequence_mean_logprobs_reference,
                                    token_entropy_reference, token_logprobs,
                                    token_logprobs_reference)


def __getattr__(name):  # the loss entry points import hacpo.engine; load them on demand
    if name in ("hacpo_loss_from_logits", "hacpo_loss_from_hidden"):
        from hacpo.kernels import hacpo_loss
        return getattr(hacpo_loss, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["token_logprobs", "sequence_mean_logprobs", "fused_linear_token_logprobs",
           "token_logprobs_reference", "sequence_mean_logprobs_reference",
           "token_entropy_reference", "fused_linear_token_logprobs_reference",
           "hacpo_loss_from_logits", "hacpo_loss_from_hidden"]
