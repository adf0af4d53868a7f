"""Shared by the megatron CPU benchmarks (bench_weight_pull.py, bench_megatron_lm_head.py):
peak resident memory probes and their random HF Llama."""
from __future__ import annotations

import torch


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Reset VmHWM (the peak resident memory) to the current resident memory."""
    with open("/proc/self/clear_refs", "w") as f:   # "5": reset the peak RSS (VmHWM)
        f.write("5")


def llama(a: dict, **config):
    """A random untied HF Llama (seed 0, fp32, eval) of ``a``'s hidden / ffn / layers / heads /
    kv_heads / vocab; ``config``: further LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a["hidden"], intermediate_size=a["ffn"],
                      num_hidden_layers=a["layers"], num_attention_heads=a["heads"],
                      num_key_value_heads=a["kv_heads"], vocab_size=a["vocab"],
                      tie_word_embeddings=False, **config)
    return LlamaForCausalLM(cfg).eval()
