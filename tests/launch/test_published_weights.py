"""Weights a megatron rank puts into the object store are in the driver policy's own shapes
(a tied output layer in no bucket); a vLLM engine fits each bucket as it loads it
(``Published.fit``, built by ``vllm_rollout.published``). Fitted, the buckets must be exactly
what ``hf_weights`` makes of the driver's policy for the engine-side weight path, tied or
untied, with or without embedding rows past the tokenizer's vocabulary."""
import time
import types

import pytest
import torch

from hacpo.launch._vllm_worker import Published
from hacpo.launch.vllm_rollout import hf_weights, published
from hacpo.models.policy import PolicyConfig, build_policy

HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def _rank_buckets(policy):
    """What MegatronAgents streams / publishes: the driver's HF state dict (a tied model's
    lm_head.weight left out), here in two buckets."""
    sd = {n: t.clone() for n, t in policy.model.state_dict().items()}
    if policy.model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    names = sorted(sd)
    return [{n: sd[n] for n in names[:3]}, {n: sd[n] for n in names[3:]}]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pad", [0, 5])
def test_fitted_buckets_are_hf_weights(tied, pad):
    pol = build_policy(PolicyConfig(kind="hf", arch="llama", tokenizer="char",
                                    hf_config={**HF, "tie_word_embeddings": tied}))
    V = pol.tokenizer.vocab_size
    if pad:       # a padded table: rows past the tokenizer's vocabulary, which vLLM never sees
        pol.model.resize_token_embeddings(V + pad)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.normal_()
    buckets = _rank_buckets(pol)
    pub = published(pol, buckets)
    assert isinstance(pub, Published) and pub.tied == tied and pub.vocab == V
    assert (pub.embed, pub.head) == ("model.embed_tokens.weight", "lm_head.weight")
    got = {n: t for b in pub.buckets for n, t in pub.fit(b).items()}
    want = hf_weights(pol)
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    assert got["lm_head.weight"].shape[0] == got["model.embed_tokens.weight"].shape[0] == V
    # what vLLM serves, from the model itself: its input and output tables' first V rows
    m = pol.model
    assert torch.equal(got["model.embed_tokens.weight"], m.get_input_embeddings().weight[:V])
    assert torch.equal(got["lm_head.weight"], m.get_output_embeddings().weight[:V])


def test_lost_published_weights_are_a_clear_error(monkeypatch):
    """Buckets owned by a rank that died cannot be fetched for the driver's pull: the error
    names the agent and says to resume (MegatronAgents._fetch_published; stand-in refs)."""
    import ray
    from ray.exceptions import OwnerDiedError

    from hacpo.launch import megatron_trainer

    def get(ref, **kw):
        if ref == "gone":
            raise OwnerDiedError("ab" * 14, None, "")
        return {"w": ref}
    monkeypatch.setattr(ray, "get", get)
    agents = megatron_trainer.MegatronAgents.__new__(megatron_trainer.MegatronAgents)
    agents.names, agents._published = ["llama"], [["b0", "b1"]]
    assert list(agents._fetch_published(0)) == [{"w": "b0"}, {"w": "b1"}]
    agents._published = [["b0", "gone"]]
    with pytest.raises(RuntimeError, match=r"the weights agent 'llama''s megatron rank 0 "
                                           r"published are lost \(OwnerDiedError: the rank "
                                           r"died\?\); resume the run .* --resume"):
        list(agents._fetch_published(0))


class _Owner:
    """Stands in for a megatron rank 0: puts a bucket into the object store (it owns it)."""

    def put(self):
        import ray
        return [ray.put({"w": torch.ones(2 ** 18)})]   # 1 MiB: in the shared object store


class _Engine:
    """Stands in for a vLLM engine actor: ``load_weights`` fetches every bucket it is sent, as
    ``VLLMWorker.load_weights`` does; ``calls`` counts its loads (a restart would reset it)."""

    def __init__(self):
        self.calls = 0

    def load_weights(self, weights, *, version):
        import ray
        self.calls += 1
        return [ray.get(ref) for ref in weights]

    def count(self):
        return self.calls


def test_engine_fetching_lost_published_weights_is_a_clear_error(cluster):
    """A real Ray cluster: the actor that put a bucket dies, then an engine of the pool is told
    to load it. Ray raises RayTaskError(OwnerDiedError) from the engine's call; the pool names
    the engine and agent and says to resume, without restarting the engine (a restart would
    fetch the same lost object)."""
    import ray

    from hacpo.launch.vllm_rollout import VLLMRolloutEngine

    owner = ray.remote(_Owner).options(num_cpus=0).remote()
    refs, lost = ray.get(owner.put.remote()), ray.get(owner.put.remote())
    engine = ray.remote(_Engine).options(num_cpus=0, max_restarts=0).remote()
    pool = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    pool.actors, pool.policies = [[engine]], [types.SimpleNamespace(name="llama")]
    pool._weights, pool._version, pool.engines_per_agent = [None], [0], 1
    pool.call_timeout_s, pool.max_restarts, pool.restarts = 0, 1, [[0]]
    pool._load(0, refs)                                   # alive owner: loads
    assert pool._version == [1] and ray.get(engine.count.remote()) == 1
    ray.kill(owner, no_restart=True)
    deadline = time.monotonic() + 60     # until Ray has marked the object lost (a moment)
    while True:
        try:
            ray.get(lost[0], timeout=10)
        except ray.exceptions.OwnerDiedError:
            break
        assert time.monotonic() < deadline, "the killed owner's object is still readable"
        time.sleep(0.5)
    with pytest.raises(RuntimeError, match=r"vLLM engine 0 of agent 0 \('llama'\): "
                                           r"load_weights could not fetch an object it was "
                                           r"sent \(OwnerDiedError\); .* --resume"):
        pool._load(0, lost)
    assert ray.get(engine.count.remote()) == 2 and pool.restarts == [[0]]   # not restarted
