"""Rollout speed on CPU: 32 prompts x G=8 x 48 new tokens, one thread.

Run: ``PYTHONPATH=. python -m tests.models.bench_generation`` (not collected by pytest).
Models: a ~0.4M-parameter decoder on the char tokenizer, and a ~1.6M-parameter decoder on
Qwen3's tokenizer reduced to the prompts' vocabulary.
"""

import platform
import random
import time

import torch

from hacpo.models.generation import generate
from hacpo.models.policy import PolicyConfig, build_policy
from hacpo.models.tokenizer import load_tokenizer

B, G, NEW = 32, 8, 48


def questions(n, seed=0):
    rng = random.Random(seed)
    names = ["Tom", "Ana", "Li", "Sam", "Maya"]
    items = ["apples", "books", "coins", "pens"]
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 9)
        out.append(f"{rng.choice(names)} has {a} {rng.choice(items)}. They buy {b} more and "
                   f"give away {c}. How many are left?")
    return out


def bench(policy, qs, repeats=3):
    prompts = [policy.tokenizer.prompt_ids(q) for q in qs]
    generate(policy, prompts[:2], num_samples=2, max_new_tokens=4)  # warm-up
    times, ro = [], None
    for r in range(repeats):
        g = torch.Generator().manual_seed(r)
        t0 = time.perf_counter()
        ro = generate(policy, prompts, num_samples=G, max_new_tokens=NEW, generator=g)
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in policy.parameters())
    t = sorted(times)[len(times) // 2]
    print(f"{policy.name:14s} params={params / 1e6:.2f}M vocab={policy.tokenizer.vocab_size} "
          f"prompt_len={min(map(len, prompts))}-{max(map(len, prompts))} "
          f"median={t:.2f}s (all {', '.join(f'{x:.2f}' for x in times)}) "
          f"new_tokens={ro.num_response_tokens} -> {ro.num_response_tokens / t:.0f} tok/s")


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    qs = questions(B)
    char = build_policy(PolicyConfig(name="char-0.4M", tokenizer="char", d_model=96,
                                     n_layers=4, n_heads=4, seed=0))
    bench(char, qs)
    tok = load_tokenizer("qwen3", corpus=questions(1000, seed=1) + qs)
    qwen = build_policy(PolicyConfig(name="qwen3red-1.6M", d_model=176, n_layers=4,
                                     n_heads=4, seed=0), tokenizer=tok)
    bench(qwen, qs)
    hf = build_policy(PolicyConfig(name="hf-llama-1.6M", kind="hf", arch="llama", seed=0,
                                   hf_config=dict(hidden_size=176, intermediate_size=472,
                                                  num_hidden_layers=4, num_attention_heads=4,
                                                  num_key_value_heads=4)), tokenizer=tok)
    bench(hf, qs)


if __name__ == "__main__":
    main()
