"""The Ray actor behind :class:`hacpo.launch.vllm_rollout.VLLMRolloutEngine`: one vLLM engine.

This module runs in the vLLM venv (``.venv-vllm``, the actor's ``py_executable``). The driver
imports it only to name the class; ``vllm`` is imported inside the actor, never at module level.

The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the
driver), so a weight update is a direct in-place ``reload_weights`` on the tensors Ray hands
the actor: no disk round-trip, no engine restart. Prompts go in and responses come out as
token ids (``skip_tokenizer_init``): the engine never needs the policy's tokenizer.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence


class VLLMWorker:
    """One vLLM ``LLM`` serving one agent's HF model.

    Args:
        hf_config: the model's HF ``config.json`` contents; written to a temp dir on this node
            (weights are not read from disk: the engine starts with ``load_format="dummy"``).
        weights: the trainer's weights of version ``version``: ObjectRefs of buckets of
            HF-named tensors (fetched one at a time while loading), or HF-named tensors.
        dtype: ``"float32" | "bfloat16" | "float16"`` (the policy's parameter dtype).
        max_model_len: prompt + response limit (the policy's ``max_len``).
        seed: engine seed (every request also carries its own seed).
        version: the weights version ``weights`` are.
    """

    def __init__(self, hf_config: dict, weights: Mapping, *, dtype: str, max_model_len: int,
                 seed: int, version: int, max_num_seqs: int = 256):
        from vllm import LLM

        self.model_dir = tempfile.mkdtemp(prefix="hacpo-vllm-model-")
        with open(os.path.join(self.model_dir, "config.json"), "w") as f:
            json.dump(hf_config, f)
        self.llm = LLM(model=self.model_dir, skip_tokenizer_init=True, load_format="dummy",
                       dtype=dtype, max_model_len=max_model_len, seed=seed,
                       logprobs_mode="processed_logprobs", generation_config="vllm",
                       enable_prefix_caching=True, max_num_seqs=max_num_seqs,
                       enforce_eager=True)
        self.version = -1
        # One forward + sampling step now, so a configuration vLLM cannot run (e.g. a head
        # size its CPU attention lacks) fails at start-up, not in the first rollout.
        from vllm import SamplingParams

        self.llm.generate([{"prompt_token_ids": [0]}],
                          SamplingParams(max_tokens=1, logprobs=0, detokenize=False),
                          use_tqdm=False)
        self.load_weights(weights, version=version)   # also drops the warm-up's prefix cache

    def info(self) -> dict:
        import torch
        import vllm

        return {"pid": os.getpid(), "vllm": vllm.__version__, "version": self.version,
                "threads": torch.get_num_threads()}

    def load_weights(self, weights: Mapping | Sequence, *, version: int) -> int:
        """Load HF-named tensors into the running model (vLLM's in-place reload: the started
        model's parameters are re-processed for the CPU kernels, so a bare
        ``model.load_weights`` after start-up is not valid), then drop the prefix cache:
        prompt KV computed with the old weights must not be reused. ``weights``: a mapping,
        or a sequence of buckets (mappings or ObjectRefs of them); a bucket is fetched when
        vLLM's loader reaches it and dropped when it moves on. Returns the tensors loaded."""
        buckets = [weights] if isinstance(weights, Mapping) else list(weights)
        count = 0

        def items():
            nonlocal count
            import ray

            for part in buckets:
                bucket = ray.get(part) if isinstance(part, ray.ObjectRef) else part
                for name, t in bucket.items():
                    count += 1
                    yield name, t
                del bucket

        self.version = -1                # not servable until the reload has completed
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items(),
                                                          "is_checkpoint_format": True})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
        self.version = version
        return count

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *,
                 max_tokens: int, temperature: float, top_p: float, eos_id: int,
                 version: int) -> list:
        """One response per prompt row (seeded) -> ``(token_ids, log-probs of the sampled
        tokens, finish_reason)`` per row. ``version``: the weights version the caller expects
        (anything else is an error, never a sample from other weights)."""
        from vllm import SamplingParams

        if version != self.version:
            raise RuntimeError(f"vLLM engine holds weights version {self.version}, the request "
                               f"needs version {version}")
        params = [SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature,
                                 top_p=top_p, seed=int(s), logprobs=0, stop_token_ids=[eos_id],
                                 detokenize=False, skip_special_tokens=False)
                  for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 use_tqdm=False)
        result = []
        for out in outs:
            c, = out.outputs
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned {len(ids)} tokens but "
                                   f"{None if c.logprobs is None else len(c.logprobs)} "
                                   f"log-prob entries")
            result.append((ids, [float(d[t].logprob) for t, d in zip(ids, c.logprobs)],
                           c.finish_reason))
        return result

    def shutdown(self) -> None:
        """Free the engine and its temp dir (the actor is killed right after)."""
        self.llm = None
        shutil.rmtree(self.model_dir, ignore_errors=True)
