"""Feature combinations a user puts together in one config: settings that each load alone but
cannot work together are errors when the config loads, naming the agent and the key, before
any data is read or policy built (not a bare error from deep inside the build)."""
import pytest

from hacpo.engine.run_config import load_config


@pytest.mark.parametrize("overrides", [
    {"agents.0.policy.reduce_vocab": True},                    # tiny3's char agent
    {"agents.1.policy.tokenizer": "char"},                     # qwen3 agent: reduce_vocab set
    {"agents.1.policy.tokenizer": "char", "agents.1.policy.kind": "hf"},
])
def test_reduce_vocab_with_char_tokenizer_is_a_config_error(overrides):
    """The character tokenizer has a fixed vocabulary: reduce_vocab on it used to pass the
    config checks and stop the run after the data was loaded with "the char tokenizer has a
    fixed vocabulary; corpus= is for HF tokenizers" (no agent, no key)."""
    agent = "char" if "agents.0.policy.reduce_vocab" in overrides else "qwen3"
    with pytest.raises(ValueError, match=rf"agent '{agent}'.*policy\.reduce_vocab=True.*"
                                         rf"policy\.tokenizer='char'.*reduce_vocab=false"):
        load_config("tiny3", overrides=overrides)


def test_reduce_vocab_with_hf_tokenizers_still_loads():
    cfg = load_config("tiny3", overrides={"agents.0.policy.tokenizer": "gpt2",
                                          "agents.0.policy.reduce_vocab": True})
    assert [a.policy.reduce_vocab for a in cfg.agents] == [True, True, True]


def _warm_start(tmp_path, cache: str, micro_batch: int):
    """tiny3's char agent, 3 warm-up steps of 16 examples, warm-started with ``micro_batch``
    in cache dir ``cache``: (its warm-up result, its weights)."""
    from hacpo.engine import build
    cfg = load_config("tiny3", overrides={
        "data.train_size": 40, "data.eval_size": 2, "agents.0.warmup.steps": 3,
        "agents.0.warmup.batch_size": 16, "micro_batch": micro_batch, "threads": 1,
        "cache_dir": str(tmp_path / cache), "out_dir": str(tmp_path / "run")})
    cfg.agents = cfg.agents[:1]
    data = build.load_data(cfg)
    policies = build.build_policies(cfg, data)
    (out,) = build.warm_start(cfg, data, policies, echo=lambda *_: None)
    return out, {k: v.clone() for k, v in policies[0].state_dict().items()}


def test_warm_start_cache_follows_the_micro_batch_that_splits_its_batches(tmp_path, one_thread):
    """A warm-up batch cut into micro-batches (micro_batch < warmup.batch_size) sums its
    gradient in another order: other weights. The cache key ignored micro_batch, so a run with
    micro_batch=4 loaded the warm start another run had trained in one piece, and the same
    config gave other results depending on what the cache held. A batch trained in one piece
    (any micro_batch >= batch_size) shares one cache entry, as before."""
    import torch

    whole, w_whole = _warm_start(tmp_path, "cache", 256)
    assert whole["cached"] is False
    again, w_again = _warm_start(tmp_path, "cache", 16)        # still one piece: a hit
    assert again["cached"] is True
    assert all(torch.equal(w_whole[k], w_again[k]) for k in w_whole)
    split, w_split = _warm_start(tmp_path, "cache", 4)         # 4 micro-batches: a miss
    assert split["cached"] is False
    fresh, w_fresh = _warm_start(tmp_path, "fresh-cache", 4)   # what it trains on its own
    assert fresh["cached"] is False
    assert all(torch.equal(w_split[k], w_fresh[k]) for k in w_split)
    assert not all(torch.equal(w_split[k], w_whole[k]) for k in w_split)   # it matters
    hit, w_hit = _warm_start(tmp_path, "cache", 4)
    assert hit["cached"] is True and all(torch.equal(w_hit[k], w_split[k]) for k in w_hit)


def test_unknown_reward_name_is_a_user_error_before_any_work(tmp_path):
    """reward.name was looked up only when the reward computer started: an unknown name was a
    KeyError traceback from inside the trainer (not the one-line config error, exit status 2,
    of every other bad config key)."""
    from hacpo.engine.errors import is_user_error
    from hacpo.engine.rewards import register_reward
    from hacpo.engine.trainer import train

    cfg = load_config("tiny3", overrides={"reward.name": "no-such-reward",
                                          "out_dir": str(tmp_path / "run")})
    with pytest.raises(ValueError, match=r"unknown reward\.name 'no-such-reward'; registered "
                                         r"rewards: .*math.* through the Python API") as e:
        train(cfg, echo=lambda *_: None)
    assert is_user_error(e.value)
    assert not (tmp_path / "run").exists()            # refused before the run dir was made

    @register_reward("test_combos_reward", in_process=True)
    def reward(response: str, gold: str) -> float:     # the caller's own reward: accepted
        return 0.0
    load_config("tiny3", overrides={"reward.name": "test_combos_reward"}).check_runnable()


def _megatron_path_agent(tmp_path, config: dict, **parallel):
    """tiny3 with its llama agent loaded from a local HF checkpoint (only its config.json is
    read when the config loads) and trained by a megatron group of ``parallel``'s layout."""
    import json
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return load_config("tiny3", overrides={
        "trainer_backend": "ray", "agents.2.policy.kind": "hf", "agents.2.policy.path": str(d),
        "agents.2.trainer": "megatron",
        **{f"agents.2.parallel.{k}": v for k, v in parallel.items()}})


LLAMA_1_LAYER = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                 "vocab_size": 1000, "hidden_act": "silu"}


def test_megatron_layout_of_a_policy_path_model_is_checked_when_the_config_loads(tmp_path):
    """The layout checks (heads / KV heads / FFN over tp, layers over pp, a Llama/Qwen
    architecture) ran on policy.arch + hf_config only: a model loaded from policy.path passed
    them, was warm-started, and then stopped the run with a traceback when its megatron group
    started ("num_hidden_layers=1 is not divisible by pipeline-parallel size pp=2")."""
    with pytest.raises(ValueError, match=r"agent 'llama' \(trainer=megatron\): "
                                         r"num_hidden_layers=1 is not divisible by "
                                         r"pipeline-parallel size pp=2"):
        _megatron_path_agent(tmp_path, LLAMA_1_LAYER, pp=2)
    with pytest.raises(ValueError, match=r"agent 'llama' \(trainer=megatron\): "
                                         r"num_key_value_heads=1 is not divisible by "
                                         r"tensor-parallel size tp=2"):
        _megatron_path_agent(tmp_path, LLAMA_1_LAYER, tp=2)
    with pytest.raises(ValueError, match=r"agent 'llama' \(trainer=megatron\): unsupported HF "
                                         r"model_type 'gpt2'"):
        _megatron_path_agent(tmp_path, {**LLAMA_1_LAYER, "model_type": "gpt2"})
    cfg = _megatron_path_agent(tmp_path, LLAMA_1_LAYER)             # TP = PP = 1: fine
    assert cfg.agents[2].trainer == "megatron"
    # a config.json this check cannot read whole is left to the model's load to name
    _megatron_path_agent(tmp_path, {"model_type": "llama"}, pp=2)
