"""The Megatron -> HF -> vLLM weight path inside ``hacpo train``: megatron-core trainer groups
(trainer_backend=ray; rank actors in .venv's Python) and real vLLM rollout engines (actors in
.venv-vllm's Python) in one private Ray cluster, which the run starts (the megatron groups
first, sized for both) and stops.

Two tiny HF Llama agents (head_dim 64, what vLLM's CPU attention serves): one at TP=2 with the
reduced Llama 3.2 BPE (562 ids, divisible by 2), one at PP=2 with the character tokenizer.
After every update ``MegatronAgents.publish_weights`` has rank 0 put the shards as HF-named
buckets into the object store (4 buckets each) and
``engine.sync_published(k, refs)`` loads them into the agent's vLLM engine (fetched one at a
time, each fitted to the served model), without the weights passing through the driver; the
driver's policy is pulled from the same buckets for the final evaluation and checkpoint. The
test probes each engine right after its initial sync and again when the run closes it (the
last thing before the rank actors go), with the same seeds:

- the engine's per-token log-probs equal the driver's HF policy's and the megatron ranks' own
  (scored on the ranks), and the ranks' gathered weights equal the driver's copy exactly, as
  do the weights the engine was last sent;
- they moved away from the pre-training weights' by far more than that tolerance;
- ``engine.stats()``: one sync per agent before step 0 and one per step, no restarts or
  timeouts.
"""
import copy
import dataclasses
import json
import os
import time

import pytest
import torch

from hacpo.engine import build
from hacpo.engine.rewards import register_reward
from hacpo.engine.run_config import ParallelConfig, load_config
from hacpo.engine.trainer import train
from hacpo.launch import megatron_trainer
from hacpo.launch.vllm_rollout import hf_weights

from tests.launch._launch_helpers import capture_instances

from .conftest import expected_logprobs, max_abs_diff

pytestmark = pytest.mark.slow

# hidden 256 = 4 heads x 64 (2 kv heads): splits at TP=2 (heads, kv heads, FFN) and PP=2 (layers)
HF = {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
      "initializer_range": 0.2}
# llama-tp2's weights are published in 4 buckets of <= 0.5 MiB (one unit each: the embedding,
# 562 x 256 fp32 = 0.55 MiB, each layer 1.5 MiB, the final norm + output layer); so are
# char-pp2's (parallel.weight_bucket_mb 1024, but rollout.weight_bucket_mb 0.5 bounds what an
# engine holds: the 0.09 MiB embedding, each layer, the final norm)
AGENTS = (("llama-tp2", "llama3.2", ParallelConfig(tp=2, weight_bucket_mb=0.5)),
          ("char-pp2", "char", ParallelConfig(pp=2)))
STEPS = 2
TOL = 2e-3        # vLLM vs a torch forward, float32 (tests/vllm/test_vllm_engine.py)
MEG_TOL = 1e-4    # megatron's fused ops vs HF's: ~1e-6 in a log-prob (test_megatron_trainer.py)
MOVED = 0.05      # training must move the served log-probs by 25x TOL at least
PROBE = dict(num_samples=2, max_new_tokens=8, temperature=1.0, top_p=1.0)


@register_reward("vllm_megatron_test_length", in_process=True)
def length_reward(response: str, gold: str) -> float:
    """Varies with the response length: non-zero advantages, so every update moves weights."""
    return (len(response) % 5) / 4.0


def megatron_vllm_cfg(tmp):
    cfg = load_config("tiny3", overrides={
        "out_dir": str(tmp / "run"), "cache_dir": str(tmp / "cache"), "threads": 1,
        "plots": False, "tensorboard": False, "progress": False, "steps": STEPS,
        "checkpoint_every": 100, "prompts_per_step": 2, "data.train_size": 16,
        "data.eval_size": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 8,
        "rollout.engine": "vllm", "rollout.weight_bucket_mb": 0.5,
        "reward.name": "vllm_megatron_test_length",
        # tiny3's nearly random agents rarely spell each other's text: keep those cross samples
        # (with the default, whether any survives depends on what the engines sample)
        "drop_unencodable": False})
    agents = []
    for (name, tok, par), a in zip(AGENTS, cfg.agents):
        pol = dataclasses.replace(a.policy, name=name, kind="hf", arch="llama", hf_config=HF,
                                  tokenizer=tok, reduce_vocab=tok != "char")
        agents.append(dataclasses.replace(a, policy=pol, trainer="megatron", parallel=par,
                                          warmup=dataclasses.replace(a.warmup, steps=0)))
    return dataclasses.replace(cfg, agents=agents, trainer_backend="ray",
                               trainer_setup_hook="tests.launch._megatron_cpu:apply")


def _probe(engine, k, prompts, seeds_state):
    """Agent k's engine samples PROBE from ``prompts`` with the generator state
    ``seeds_state`` (so both probes use the same seeds); the run's own generator is restored."""
    own = engine.state_dict()
    engine.load_state_dict(seeds_state)
    try:
        return engine.generate(k, prompts, **PROBE)
    finally:
        engine.load_state_dict(own)


def _rank_logprobs(agents, k, world, prompts, responses):
    """Per-token log-probs (temperature 1) of ``responses`` computed on agent k's megatron
    ranks (their own shards), from the rank that reports them."""
    import ray

    refs = [agents.rank_actor(k, r).old_logprobs.remote(prompts, responses, 4, 1.0)
            for r in range(world)]
    got = [x for x in ray.get(refs, timeout=120) if x is not None]
    assert len(got) == 1 and got[0]["rows"] == list(range(len(responses))), got
    return [t.tolist() for t in got[0]["toks"]]


def _rank_weights(agents, k, world):
    import ray

    out = ray.get([agents.rank_actor(k, r).hf_weights.remote() for r in range(world)],
                  timeout=120)
    assert out[0] is not None and all(w is None for w in out[1:])
    return out[0]


def test_megatron_weights_reach_the_vllm_engines(tmp_path, monkeypatch):
    import ray

    cfg = megatron_vllm_cfg(tmp_path)
    data = build.load_data(cfg)
    engines, probes = [], {}
    checks: dict = {}

    groups = capture_instances(monkeypatch, megatron_trainer.MegatronAgents)

    def check_before_close(engine):
        """What the engines serve at the end of the run, while ranks and engines still live."""
        checks["stats"] = engine.stats()
        agents, = groups
        for k, (name, _, par) in enumerate(AGENTS):
            pol, (prompts, state, before, initial) = engine.policies[k], probes[k]
            after = _probe(engine, k, prompts, state)
            sp, resps = after.sample_prompts(), after.response_ids
            hf_lp, _ = expected_logprobs(pol, sp, resps, temperature=1.0, top_p=1.0)
            meg_lp = _rank_logprobs(agents, k, par.world, sp, resps)
            init_lp, _ = expected_logprobs(initial, sp, resps, temperature=1.0, top_p=1.0)
            meg_w = _rank_weights(agents, k, par.world)
            driver = pol.model.state_dict()
            # what the last sync shipped: the buckets agent k's rank 0 put (sync_published),
            # as the engines fit them
            pub = engine._weights[k]
            buckets = [pub.fit(b) for b in ray.get(list(pub.buckets))]
            sent = {n: t for b in buckets for n, t in b.items()}
            checks[name] = {
                "engine_vs_hf": max_abs_diff(after.sampler_logprobs, hf_lp),
                "engine_vs_megatron": max_abs_diff(after.sampler_logprobs, meg_lp),
                "megatron_vs_hf": max_abs_diff(meg_lp, hf_lp),
                "engine_vs_initial": max_abs_diff(after.sampler_logprobs, init_lp),
                "before_vs_initial": before["vs_initial"],
                "spread": max(x for r in hf_lp for x in r) - min(x for r in hf_lp for x in r),
                "same_responses_as_before": resps == before["responses"],
                "engine_before_after": (max_abs_diff(after.sampler_logprobs, before["lp"])
                                        if resps == before["responses"] else None),
                "weights_moved": max((driver[n] - w).abs().max().item()
                                     for n, w in initial.model.state_dict().items()),
                "tied": bool(pol.model.config.tie_word_embeddings),
                "megatron_keys_missing": sorted(set(driver) - set(meg_w)),
                "megatron_unequal": [n for n, w in meg_w.items()
                                     if not torch.equal(w, driver[n])],
                "sent_unequal": sorted(n for n, w in hf_weights(pol).items()
                                       if n not in sent or not torch.equal(w, sent[n])),
                "published": type(pub).__name__,
                "buckets": agents.weight_buckets[k],
                "sent_buckets": len(buckets),
            }

    def capture(cfg_, policies, agents=None):
        engine = build_engine(cfg_, policies, agents)
        engines.append(engine)
        real_sync, real_close = engine.sync_weights, engine.close

        def sync_weights(k):
            real_sync(k)
            if k not in probes:        # the initial sync, before step 0: pre-training weights
                pol = engine.policies[k]
                prompts = [pol.tokenizer.prompt_ids(build.prompt_text(cfg_, e))
                           for e in data.eval + data.train[:2]]
                state = engine.state_dict()
                ro = _probe(engine, k, prompts, state)
                want, _ = expected_logprobs(pol, ro.sample_prompts(), ro.response_ids,
                                            temperature=1.0, top_p=1.0)
                probes[k] = (prompts, state, {"lp": ro.sampler_logprobs,
                                              "responses": ro.response_ids,
                                              "vs_initial": max_abs_diff(ro.sampler_logprobs,
                                                                         want)},
                             copy.deepcopy(pol))

        def close():
            try:
                if not engine._closed and "stats" not in checks:
                    check_before_close(engine)
            except Exception as e:     # reported by the test, not instead of the run's error
                checks["error"] = e
            finally:
                real_close()
        engine.sync_weights, engine.close = sync_weights, close
        return engine

    build_engine = build.rollout_engine
    monkeypatch.setattr(build, "rollout_engine", capture)
    connected = ray.is_initialized()
    t0 = time.perf_counter()
    summary = train(cfg, echo=lambda *a: None)
    seconds = time.perf_counter() - t0
    print(f"\ntrain: {seconds:.1f} s; " + json.dumps(
        {k: v for k, v in checks.items() if k != "stats"}, indent=1, default=str))

    assert "error" not in checks, checks.get("error")
    engine, = engines
    assert type(engine).__name__ == "VLLMRolloutEngine" and engine._closed
    assert summary["steps"] == STEPS and summary["agents"] == [a[0] for a in AGENTS]
    # (c) one sync per agent before step 0 and one after each of its updates; nothing restarted
    assert checks["stats"] == {"restarts": [[0], [0]], "timeouts": [[0], [0]],
                               "versions": [1 + STEPS, 1 + STEPS]}
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["rollout/versions"] for r in rows] == [2.0 + 2 * s for s in range(1, STEPS + 1)]
    assert all(r["rollout/restarts"] == 0 and r["rollout/timeouts"] == 0 for r in rows)
    for name, _, _ in AGENTS:
        c = checks[name]
        assert all(r[f"train/{name}/grad_norm"] > 1e-3 for r in rows), name
        assert sum(r[f"train/{name}/cross_count"] for r in rows) > 0, name  # cross term too
        # the probe can tell weights apart: log-probs spread over several nats
        assert c["spread"] > 2.0, (name, c)
        # before training the engine served the initial weights
        assert c["before_vs_initial"] < TOL, (name, c)
        # (a) after training: the ranks' weights are the driver's HF copy, bit for bit, and
        # that copy is what the engine was last sent ...
        # (a tied output embedding is the input embedding's tensor: megatron sends it once)
        assert c["megatron_keys_missing"] == (["lm_head.weight"] if c["tied"] else []), c
        assert c["megatron_unequal"] == [] and c["sent_unequal"] == [], (name, c)
        assert c["buckets"] == 4, (name, c)
        # the engines loaded rank 0's own buckets (not a driver re-put)
        assert c["published"] == "Published" and c["sent_buckets"] == c["buckets"], (name, c)
        # ... and the engine's log-probs are the HF copy's and the megatron ranks' own
        assert c["megatron_vs_hf"] < MEG_TOL, (name, c)
        assert c["engine_vs_hf"] < TOL and c["engine_vs_megatron"] < TOL, (name, c)
        # (b) training moved them: the sync was not a no-op
        assert c["weights_moved"] > 5e-4, (name, c)
        assert c["engine_vs_initial"] > MOVED, (name, c)
        if c["engine_before_after"] is not None:     # same samples as before: scored anew
            assert c["engine_before_after"] > MOVED, (name, c)
    assert ray.is_initialized() == connected          # the run's private cluster is gone
