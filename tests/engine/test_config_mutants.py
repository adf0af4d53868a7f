"""Run config behaviour a mutation audit of hacpo/engine/configtools.py and run_config.py
found untested: --set spellings and whole-section keys, the closed ends of ranges, values of
numpy types, the defaults a YAML agent list starts from, and what the resume fingerprint
compares."""
import json
import re

import numpy as np
import pytest

from hacpo.engine.run_config import config_diff, fingerprint_dict, load_config


# -- --set spellings ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["None", "NULL", "none", "null"])
def test_null_spellings_clear_an_optional_value_in_any_case(text):
    """"none" / "null" in any case is None for an ``X | None`` field: a string one too (a
    data.eval_path of "NULL" would be a file named NULL)."""
    cfg = load_config("tiny3", overrides={
        "rollout.engine": "vllm", "rollout.device": "cuda",
        "rollout.gpu_memory_utilization": "0.7", "data.task": "files",
        "data.train_path": "a.jsonl", "data.eval_path": "b.jsonl"})
    got = cfg.override({"rollout.gpu_memory_utilization": text, "data.eval_path": text,
                        "data.eval_size": "0"})
    assert got.rollout.gpu_memory_utilization is None and got.data.eval_path is None


def test_a_word_that_is_no_boolean_says_it_cannot_be_parsed():
    with pytest.raises(ValueError, match=r"^cannot parse 'maybe' as bool for config key "
                                         r"'progress'$"):
        load_config("tiny3", overrides={"progress": "maybe"})


def test_an_agent_entry_set_as_a_whole_is_an_error_not_ignored():
    """``--set agents.0=...`` names a section (an agent): an error, as ``--set rollout=...``
    is, never a key that silently changes nothing."""
    for key in ("agents.0", "agents.2"):
        with pytest.raises(ValueError, match=rf"config key '{key}' is a section; set one of "
                                             rf"its fields"):
            load_config("tiny3", overrides={key: "{optim: {lr: 1.0e-3}}"})


def test_numpy_numbers_become_python_numbers():
    """Values computed with numpy (a sweep's np.int64 / np.float32) are stored as the plain
    int / float the checks, config.json and the fingerprint's hash take."""
    cfg = load_config("tiny3").override({"steps": np.int64(3), "agents.0.optim.lr":
                                         np.float32(0.5), "rollout.temperature": np.int64(1)})
    assert type(cfg.steps) is int and cfg.steps == 3
    assert type(cfg.agents[0].optim.lr) is float and cfg.agents[0].optim.lr == 0.5
    assert type(cfg.rollout.temperature) is float and cfg.rollout.temperature == 1.0
    assert json.loads(json.dumps(cfg.to_dict()))["steps"] == 3


# -- closed ends of ranges ---------------------------------------------------------------------
def test_the_largest_seed_the_error_names_loads():
    """"seeds are integers in [0, 4294967295]": both ends load, one past the top does not."""
    top = 2**32 - 1
    cfg = load_config("tiny3", overrides={"seed": str(top), "data.seed": str(top),
                                          "agents.0.policy.seed": str(top)})
    assert (cfg.seed, cfg.data.seed, cfg.agents[0].policy.seed) == (top, top, top)
    assert load_config("tiny3", overrides={"seed": "0"}).seed == 0
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 4294967295\]"):
        load_config("tiny3", overrides={"seed": str(top + 1)})


def test_a_timeout_of_0_means_no_limit_and_loads():
    """"0: no limit" (rollout.call_timeout_s, trainer_call_timeout_s) is an allowed value."""
    cfg = load_config("tiny3", overrides={"rollout.call_timeout_s": "0",
                                          "trainer_call_timeout_s": "0"})
    assert (cfg.rollout.call_timeout_s, cfg.trainer_call_timeout_s) == (0.0, 0.0)


@pytest.mark.parametrize("key,name", [
    ("rollout.weight_bucket_mb", "rollout.weight_bucket_mb"),
    ("agents.0.parallel.weight_bucket_mb", "parallel.weight_bucket_mb")])
def test_an_infinite_weight_bucket_is_an_error(key, name):
    over = {"agents.0.policy.kind": "hf", "agents.0.trainer": "megatron",
            "trainer_backend": "ray"}
    with pytest.raises(ValueError, match=rf"{name} must be a number > 0, got inf"):
        load_config("tiny3", overrides={**over, key: "inf"})


# -- settings that cannot work ---------------------------------------------------------------
def test_a_reduced_vocabulary_of_the_char_tokenizer_is_an_error_at_load():
    with pytest.raises(ValueError, match=r"^agent 'char': policy.reduce_vocab=True reduces a "
                                         r"Hugging Face tokenizer's vocabulary to the data, but "
                                         r"policy.tokenizer='char' has a fixed character set"):
        load_config("tiny3", overrides={"agents.0.policy.reduce_vocab": "true"})


@pytest.mark.parametrize("over,msg", [
    ({"agents.1.policy.name": "char"},
     r"agent names must be unique, got \['char', 'char', 'llama'\]"),
    ({"agents.0.policy.kind": "hf", "agents.0.trainer": "megatron"},
     r"agents \['char'\] use trainer=megatron, which runs as Ray rank actors: set "
     r"trainer_backend=ray \(got 'local'\)"),
    ({"agents.0.trainer": "megatron", "trainer_backend": "ray"},
     r"^agent 'char' \(trainer=megatron\): needs an HF policy \(policy.kind='hf'\), got "
     r"kind='decoder'$"),
    ({"trainer_setup_hook": "tests.hooks"},
     r"trainer_setup_hook must look like 'package.module:function', got 'tests.hooks'"),
])
def test_run_wide_settings_that_cannot_work_are_errors_at_load(over, msg):
    """Two agents of one name (their files and metric keys collide), a megatron agent without
    Ray trainers or with a plain decoder policy, a setup hook without its function."""
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", overrides=over)


@pytest.mark.parametrize("name,why", [(".", "may not be '.' or '..'"),
                                      ("a\x07b", "may not contain '\\x07'")])
def test_agent_names_dot_and_control_characters_are_refused(name, why):
    """'.' names the cache folder itself (always refused); a control character garbles metric
    keys and logs (refused for a new run)."""
    from hacpo.engine.run_config import check_new_run_names
    pattern = r"agents\.0\.policy\.name=.*" + re.escape(why)
    if name == ".":
        with pytest.raises(ValueError, match=pattern):
            load_config("tiny3", overrides={"agents.0.policy.name": name})
    else:
        cfg = load_config("tiny3", overrides={"agents.0.policy.name": name})
        with pytest.raises(ValueError, match=pattern):
            check_new_run_names(cfg)


def test_a_stored_decoder_policys_hf_fields_at_their_defaults_are_not_dropped():
    """A saved config holds every policy field: a decoder's arch / hf_config / path at their
    defaults were never set, so nothing is dropped (or said); one that differs is."""
    from hacpo.engine.run_config import drop_unused_policy_settings
    pol = load_config("tiny3").to_dict()["agents"][0]["policy"]
    assert drop_unused_policy_settings(dict(pol)) == []
    old = {**pol, "arch": "gpt2", "hf_config": {"n_embd": 8}}
    assert drop_unused_policy_settings(old) == ["policy.arch='gpt2'",
                                                "policy.hf_config={'n_embd': 8}"]
    assert "arch" not in old and "hf_config" not in old and "path" in old


def test_an_agents_list_replaces_the_decoder_sizes_set_before_it():
    """A dotted key on agent 0 followed by an agents list: the list replaces that agent, so a
    decoder size set on the old one is no error for the new (saved, kind='hf') one."""
    saved = load_config("tiny3", overrides={"agents.0.policy.kind": "hf"}).to_dict()["agents"]
    cfg = load_config("tiny3").override({"agents.0.policy.d_model": "64", "agents": saved})
    assert cfg.agents[0].policy.kind == "hf" and cfg.agents[0].policy.d_model == 32


def test_pool_settings_are_said_unused_only_without_a_pool():
    """rollout.engines_per_agent & co. are read by the Ray / vLLM pools: with engine='local'
    they are said unused, with 'ray' they are not; ray_address is used by a Ray trainer."""
    from hacpo.engine.run_config import unused_rollout_settings
    pool = {"rollout.engines_per_agent": 2, "rollout.ray_address": "10.0.0.1:6379"}
    local = load_config("tiny3", overrides=pool)
    assert unused_rollout_settings(local) == ["rollout.engines_per_agent=2",
                                              "rollout.ray_address='10.0.0.1:6379'"]
    assert unused_rollout_settings(local.override({"trainer_backend": "ray"})) == [
        "rollout.engines_per_agent=2"]
    assert unused_rollout_settings(local.override({"rollout.engine": "ray"})) == []


# -- the resume fingerprint --------------------------------------------------------------------
def test_a_changed_number_of_agents_or_policy_dtype_blocks_a_resume():
    """One agent fewer (or more) is a difference, not the agents both runs have in common; so
    is an agent's dtype (other numbers); the engine's restart budget is not (same samples)."""
    cfg = load_config("tiny3")
    a = fingerprint_dict(cfg)
    two = fingerprint_dict(cfg.override({"agents": cfg.to_dict()["agents"][:2]}))
    assert config_diff(a, two) == ["agents"]
    assert config_diff(a, fingerprint_dict(cfg.override(
        {"agents.2.policy.dtype": "bfloat16"}))) == ["agents.2.policy.dtype"]
    assert config_diff(a, fingerprint_dict(cfg.override(
        {"rollout.max_engine_restarts": 0, "rollout.ray_address": "h:1"}))) == []


def test_config_diff_names_the_index_of_a_changed_list_item():
    assert config_diff({"a": [1, 2], "b": {"c": [3]}}, {"a": [1, 5], "b": {"c": [4]}}) == [
        "a.1", "b.c.0"]


def test_config_hash_does_not_depend_on_key_order():
    """A config read back (a checkpoint, a summary.json) hashes as the one written."""
    from hacpo.engine.run_config import config_hash
    d = load_config("tiny3").to_dict()
    assert config_hash(d) == config_hash(dict(reversed(list(d.items()))))


# -- defaults ----------------------------------------------------------------------------------
def test_the_defaults_an_agents_list_and_the_default_preset_start_from():
    """A YAML agents list builds each agent from the defaults (README: "a list replaces them
    (each agent built from the defaults)"), and keys no preset sets keep theirs: a changed
    default silently changes every such run."""
    cfg = load_config("default", overrides={"agents": [{"policy": {"name": "a"}}]})
    a = cfg.agents[0]
    assert (a.optim.lr, a.optim.weight_decay, a.optim.beta1, a.optim.beta2,
            a.optim.grad_clip) == (1e-4, 0.0, 0.9, 0.99, 1.0)
    assert (a.warmup.steps, a.warmup.lr, a.warmup.batch_size, a.trainer) == \
        (0, 3e-3, 32, "torch")
    assert (cfg.micro_batch, cfg.checkpoint_every, cfg.max_nonfinite, cfg.drop_unencodable,
            cfg.eval_every, cfg.eval_engine, cfg.trainer_backend, cfg.seed) == \
        (256, 10, 3, True, 0, "trainer", "local", 0)
    r = cfg.rollout
    assert (r.engine, r.top_p, r.max_engine_restarts, r.call_timeout_s) == \
        ("local", 1.0, 3, 1800.0)
    assert (cfg.reward.name, cfg.reward.num_workers, cfg.reward.timeout_s) == ("math", 0, 5.0)


# -- files the config names --------------------------------------------------------------------
def test_relative_paths_that_exist_are_made_absolute(tmp_path, monkeypatch):
    """A tokenizer folder (not a known tokenizer's name) and, in a stored config, both data
    files and the model folder: named by absolute path, wherever a resume or eval runs."""
    from hacpo.engine.run_config import resolve_paths, resolve_stored_paths
    monkeypatch.chdir(tmp_path)
    for name in ("tok", "qwen3", "m"):
        (tmp_path / name).mkdir()
    for name in ("t.jsonl", "e.jsonl"):
        (tmp_path / name).write_text("")
    cfg = resolve_paths(load_config("tiny3", overrides={"agents.0.policy.tokenizer": "tok"}))
    assert [a.policy.tokenizer for a in cfg.agents] == [str(tmp_path / "tok"), "qwen3",
                                                        "llama3.2"]
    d = resolve_stored_paths({"data": {"train_path": "t.jsonl", "eval_path": "e.jsonl"},
                              "agents": [{"policy": {"path": "m", "tokenizer": "m"}}]})
    assert d == {"data": {"train_path": str(tmp_path / "t.jsonl"),
                          "eval_path": str(tmp_path / "e.jsonl")},
                 "agents": [{"policy": {"path": str(tmp_path / "m"),
                                        "tokenizer": str(tmp_path / "m")}}]}


def test_a_yaml_hf_config_mapping_is_one_value(tmp_path):
    """hf_config's keys are the transformers config's, not config keys: a YAML mapping under
    it is set as a whole (as ``--set ...hf_config='{...}'``), not flattened into dotted keys."""
    path = tmp_path / "run.yaml"
    path.write_text("agents: {0: {policy: {kind: hf, hf_config: {hidden_size: 64}}}}\n")
    assert load_config("tiny3", str(path)).agents[0].policy.hf_config == {"hidden_size": 64}


def test_revalidated_takes_a_train_config_only():
    from hacpo.engine.run_config import revalidated
    with pytest.raises(TypeError, match=r"^expected a TrainConfig, got dict$"):
        revalidated(load_config("tiny3").to_dict())
