"""Run config validation at load time: counts and ranges, the type of every YAML / override
value, the YAML file's shape, errors that name the agent, and policy settings nothing would
use. Each bad value is a clear ValueError naming the key before anything is built."""
import json
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest

from hacpo.engine.configtools import from_dict
from hacpo.engine.run_config import load_config


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


# -- counts and ranges ------------------------------------------------------------------------
@pytest.mark.parametrize("key,bad,msg", [
    # trainer.py divides by checkpoint_every and steps through range(.., micro_batch)
    ("checkpoint_every", "0", r"checkpoint_every must be an integer >= 1 \(the last step is "
                              r"always saved\), got 0"),
    ("micro_batch", "0", r"micro_batch must be an integer >= 1, got 0"),
    ("steps", "-1", r"steps must be an integer >= 0 \(0: no RL steps\), got -1"),
    ("prompts_per_step", "0", r"prompts_per_step must be an integer >= 1, got 0"),
    ("max_nonfinite", "0", r"max_nonfinite must be an integer >= 1, got 0"),
    ("eval_every", "-1", r"eval_every must be an integer >= 0 \(0: evaluate before and after "
                         r"training only\), got -1"),
    ("eval_max_new_tokens", "-1", r"eval_max_new_tokens must be an integer >= 0"),
    ("eval_pass_k", "-2", r"eval_pass_k must be an integer >= 0 .*got -2"),
    ("threads", "-1", r"threads must be an integer >= 0 \(0: torch's default\), got -1"),
    ("rollout.group_size", "0", r"rollout.group_size must be an integer >= 1, got 0"),
    ("rollout.max_new_tokens", "0", r"rollout.max_new_tokens must be an integer >= 1, got 0"),
    ("rollout.engines_per_agent", "0", r"rollout.engines_per_agent must be an integer >= 1"),
    ("rollout.max_engine_restarts", "-1", r"rollout.max_engine_restarts must be an integer "
                                          r">= 0, got -1"),
    ("data.train_size", "0", r"data.train_size must be an integer >= 1, got 0"),
    ("data.eval_size", "-1", r"data.eval_size must be an integer >= 0 \(0: no held-out set\)"),
    ("reward.num_workers", "-1", r"reward.num_workers must be an integer >= 0"),
    ("reward.timeout_s", "0", r"reward.timeout_s must be a finite number > 0, got 0.0"),
    # an infinite timeout crashed every call: Ray's and threading's waits overflow on inf
    ("reward.timeout_s", "inf", r"reward.timeout_s must be a finite number > 0, got inf"),
    ("rollout.call_timeout_s", "inf", r"rollout.call_timeout_s must be a finite number >= 0 "
                                      r"\(0: no limit\), got inf"),
    ("rollout.call_timeout_s", "-1", r"rollout.call_timeout_s must be a finite number >= 0"),
    ("trainer_call_timeout_s", "1e400", r"trainer_call_timeout_s must be a finite number >= "
                                        r"0 \(0: no limit\), got inf"),
    ("rollout.gpu_memory_utilization", "0.5", r"rollout.gpu_memory_utilization=0.5 is for "
                                              r"vLLM engines on GPUs .*nothing would use it"),
    # a temperature whose reciprocal overflows float32: an error after the warm-up before
    ("rollout.temperature", "1e-39", r"rollout.temperature=1e-39 is too small: 1/temperature "
                                     r"overflows float32 \(use 0 for greedy\)"),
    # omega is float32 in the loss: a bound past its range made it inf mid-run
    ("algorithm.capability.ratio_max", "1e300", r"capability.ratio_max must be <= 3.403e\+38"),
    ("algorithm.capability.ratio_min", "1e-300", r"capability.ratio_min must be finite and >= "
                                                 r"1.175e-38"),
    ("agents.0.warmup.steps", "-1", r"warmup.steps must be an integer >= 0"),
    ("agents.0.warmup.batch_size", "0", r"warmup.batch_size must be an integer >= 1, got 0"),
    ("agents.0.warmup.lr", "0", r"warmup.lr must be a finite number > 0, got 0.0"),
    ("agents.0.optim.lr", "nan", r"optim.lr must be a finite number > 0, got nan"),
    ("agents.0.optim.weight_decay", "-0.1", r"optim.weight_decay must be a finite number >= 0, "
                                            r"got -0.1"),
    ("agents.0.optim.weight_decay", "inf", r"optim.weight_decay must be a finite number >= 0"),
    # seeds: the rollout's per-agent seed * 1000 + k overflowed torch's 64 bits after the
    # warm-up (a traceback, a half-made run dir)
    ("seed", "9223372036854775807", r"seed must be an integer in \[0, 4294967295\], got 92"),
    ("seed", "-1", r"seed must be an integer in \[0, 4294967295\], got -1"),
    ("data.seed", "4294967296", r"data.seed must be an integer in \[0, 4294967295\]"),
    ("agents.0.policy.seed", "99999999999999999999",
     r"agent 'char'.*policy.seed must be an integer in \[0, 4294967295\]"),
    ("agents.0.optim.beta1", "1", r"optim.beta1 must be in \[0, 1\), got 1.0"),
    ("agents.0.optim.beta2", "-0.5", r"optim.beta2 must be in \[0, 1\), got -0.5"),
    ("agents.0.optim.grad_clip", "nan", r"optim.grad_clip must be >= 0 \(0: no clipping\), "
                                        r"got nan"),
    ("algorithm.advantage.eps", "0", r"advantage.eps must be finite and > 0 \(a uniform or "
                                     r"one-sample group's sigma is eps; "),
    ("algorithm.advantage.eps", "inf", r"advantage.eps must be finite and > 0 .*, got inf"),
    ("algorithm.capability.minimum", "5", r"capability.minimum must be in \(0, 1\) .*, got 5"),
    ("algorithm.loss.alpha", "inf", r"loss.alpha must be finite and >= 0, got inf"),
    ("agents.0.policy.n_layers", "0", r"policy.n_layers must be an integer >= 1, got 0"),
    # data files with the embedded task: trained on the embedded task, the files never read
    ("data.train_path", "tr.jsonl", r"data.train_path='tr.jsonl' only applies to "
                                    r"data.task='files' \(data.task='arithmetic' trains on the "
                                    r"embedded task\): set data.task=files to read them"),
    ("agents.0.policy.max_len", "0", r"policy.max_len must be an integer >= 1, got 0"),
    ("agents.0.policy.dtype", "fp8", r"policy.dtype must be one of float32, bfloat16, "
                                     r"float16, got 'fp8'"),
    # "--set out_dir=" (an unset shell variable) was "[Errno 2] No such file or directory: ''"
    ("out_dir", "", r"out_dir must be a directory path, got ''"),
    ("cache_dir", " ", r"cache_dir must be a directory path, got ' '"),
])
def test_counts_and_ranges_are_checked_at_load(key, bad, msg):
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", overrides={key: bad})


def test_lowest_allowed_values_load():
    """0 where 0 has a meaning (no RL steps, no periodic eval, torch's threads, no held-out
    set, no warm-up, no clipping, greedy sampling, in-process rewards)."""
    cfg = load_config("tiny3", overrides={
        "steps": "0", "eval_every": "0", "threads": "0", "data.eval_size": "0",
        "agents.0.warmup.steps": "0", "agents.0.optim.grad_clip": "0",
        "rollout.temperature": "0", "rollout.top_p": "1", "reward.num_workers": "0",
        "checkpoint_every": "1", "micro_batch": "1"})
    assert (cfg.steps, cfg.checkpoint_every, cfg.micro_batch, cfg.rollout.temperature) == \
        (0, 1, 1, 0.0)


def test_highest_allowed_values_load():
    """The closed ends the error messages name load: loss.cross_clip_delta 1 ("in [0, 1]";
    SPEC: lower clip bound 1 - delta), capability.ratio_min equal to ratio_max ("<=": both 1,
    which the range must hold), rollout.gpu_memory_utilization 1 ("in (0, 1]")."""
    cfg = load_config("tiny3", overrides={
        "algorithm.loss.cross_clip_delta": "1", "algorithm.capability.ratio_min": "1",
        "algorithm.capability.ratio_max": "1"})
    cap = cfg.algorithm.capability
    assert (cfg.algorithm.loss.cross_clip_delta, cap.ratio_min, cap.ratio_max) == (1.0, 1.0, 1.0)
    gpu = load_config("tiny3", overrides={"rollout.engine": "vllm", "rollout.device": "cuda",
                                          "rollout.gpu_memory_utilization": "1"})
    assert gpu.rollout.engine_memory_fraction() == 1.0


def test_vllm_temperature_and_head_split_rules():
    """vLLM samples at temperature 0 or in [0.01, 2] (both ends included), and splits a model
    over tp workers when the attention heads divide by tp and the KV heads divide by tp or,
    fewer than tp, divide it (None: as many KV heads as attention heads)."""
    from hacpo.engine.run_config import check_vllm_temperature, engine_tp_problem
    for ok in (0, 0.01, 1.0, 2.0):
        check_vllm_temperature(ok)
    for bad in (0.009, 2.001, -1.0):
        with pytest.raises(ValueError, match="cannot be served"):
            check_vllm_temperature(bad)
    cases = [((2, 1, 3), "2 attention heads"), ((12, 3, 4), "3 KV heads"),
             ((6, 3, 2), "3 KV heads"), ((12, None, 8), "12 attention heads"),
             ((12, 4, 2), None), ((8, 2, 4), None), ((12, 3, 6), None), ((8, None, 4), None),
             ((9, 3, 3), None), ((4, 4, 1), None)]
    for args, want in cases:
        assert engine_tp_problem(*args) == want, args


@pytest.mark.parametrize("key,bad,msg", [
    ("rollout.temperature", "-1", r"rollout.temperature must be a finite number >= 0 "
                                  r"\(0: greedy\), got -1.0"),
    ("rollout.temperature", "inf", r"rollout.temperature must be a finite number >= 0"),
    ("rollout.top_p", "0", r"rollout.top_p must be in \(0, 1\] \(1: off\), got 0.0"),
    ("rollout.top_p", "1.5", r"rollout.top_p must be in \(0, 1\] \(1: off\), got 1.5"),
])
def test_sampling_settings_are_checked_at_load(key, bad, msg):
    """Not only at the first rollout, after the warm-up."""
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", overrides={key: bad})


# -- types of YAML (and programmatic) values --------------------------------------------------
@pytest.mark.parametrize("text,msg", [
    ("rollout: {group_size: 2.5}", r"rollout.group_size must be an integer >= 1, got 2.5"),
    ("steps: 1.5", r"steps must be an integer >= 0 \(0: no RL steps\), got 1.5"),
    ("steps: 2.0", r"steps must be an integer >= 0 .*got 2.0"),     # as "--set steps=2.0"
    ("seed: true", r"config key 'seed' must be an integer, got True \(bool\)"),
    ("agents: {0: {optim: {lr: [1]}}}",
     r"^agent 'char' \(agents.0\): config key 'agents.0.optim.lr' must be a number, got \[1\] "
     r"\(list\)$"),
    ("rollout: {temperature: true}", r"config key 'rollout.temperature' must be a number, "
                                     r"got True \(bool\)"),
    ("progress: 1", r"config key 'progress' must be true or false, got 1 \(int\)"),
    ("out_dir: 5", r"config key 'out_dir' must be a string, got 5 \(int\)"),
    ("rollout: {gpu_memory_utilization: high}", r"cannot parse 'high' as float for config key "
                                                r"'rollout.gpu_memory_utilization'"),
    ("data: {train_path: [a.jsonl]}", r"config key 'data.train_path' must be a string or null, "
                                      r"got \['a.jsonl'\] \(list\)"),
    ("agents: {1: {policy: {kind: gpt}}}", r"config key 'agents.1.policy.kind' must be one of "
                                           r"'decoder', 'hf', got 'gpt' \(str\)"),
    ("agents: {1: {policy: {kind: hf, hf_config: [1]}}}",
     r"config key 'agents.1.policy.hf_config' must be a mapping, got \[1\] \(list\)"),
    ("algorithm: {advantage: {binary_guard: 0}}",
     r"config key 'algorithm.advantage.binary_guard' must be true or false, got 0 \(int\)"),
    ("agents:\n  - {policy: {name: a}}\n  - {policy: {name: b}, optim: {lr: '1e-3x'}}",
     r"agent 'b' \(agents.1\): cannot parse '1e-3x' as float for config key 'agents.1.optim.lr'"),
    ("agents: [1]", r"config section 'agents.0' must be a mapping, got int"),
])
def test_yaml_values_of_the_wrong_type_are_clear_errors(tmp_path, text, msg):
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", _yaml(tmp_path, text))


def test_yaml_values_of_another_spelling_are_converted(tmp_path):
    """An int where a float is expected is that float; YAML strings (``1e-3`` without a dot is
    one) are parsed as the field's type, in a whole agents list too."""
    cfg = load_config("tiny3", _yaml(tmp_path, "agents: {0: {optim: {lr: 1}}}\n"
                                               "rollout: {temperature: 1}\n"))
    assert cfg.agents[0].optim.lr == 1.0 and isinstance(cfg.agents[0].optim.lr, float)
    assert isinstance(cfg.rollout.temperature, float)
    cfg = load_config("tiny3", _yaml(tmp_path, "agents:\n"
                                               "  - {policy: {name: a}, optim: {lr: 1e-3}}\n"
                                               "  - {policy: {name: b}, warmup: {steps: '3'}}\n"))
    assert (cfg.agents[0].optim.lr, cfg.agents[1].warmup.steps) == (1e-3, 3)
    assert load_config("tiny3", _yaml(tmp_path, "")).steps == load_config("tiny3").steps
    # programmatic overrides: the same checks (bools are no numbers)
    with pytest.raises(ValueError, match=r"config key 'agents.0.optim.lr' must be a number, "
                                         r"got True \(bool\)"):
        load_config("tiny3").override({"agents.0.optim.lr": True})


@dataclass
class _Leaf:
    n: int = 1
    x: float = 1.0
    on: bool = False
    s: str = "a"
    opt: float | None = None
    kind: Literal["p", "q"] = "p"
    names: list[str] = field(default_factory=list)
    table: dict[str, int] = field(default_factory=dict)


@pytest.mark.parametrize("key,bad,expected", [
    ("n", 2.5, "an integer"), ("n", True, "an integer"), ("x", True, "a number"),
    ("on", 1, "true or false"), ("s", 1, "a string"), ("opt", False, "a number or null"),
    ("kind", "r", "one of 'p', 'q'"), ("kind", 1, "one of 'p', 'q'"),
    ("names", ["a", 1], "a list of a string"), ("names", "a", "a list of a string"),
    ("table", {"a": 1.5}, "a mapping"),
])
def test_from_dict_checks_every_kind_of_annotation(key, bad, expected):
    """configtools.from_dict against each kind of annotation the configs use."""
    with pytest.raises(ValueError, match=rf"^config key 'leaf.{key}' must be {expected}, got "
                                         rf"{re.escape(repr(bad))} \({type(bad).__name__}\)$"):
        from_dict(_Leaf, {key: bad}, "leaf.")


@pytest.mark.parametrize("key,value,got", [
    ("n", "2", 2), ("x", "1.5", 1.5), ("x", 3, 3.0), ("on", "yes", True), ("opt", "none", None),
    ("opt", 2, 2.0), ("kind", "q", "q"), ("names", ["a"], ["a"]), ("table", {"a": 1}, {"a": 1}),
])
def test_from_dict_converts_other_spellings(key, value, got):
    out = getattr(from_dict(_Leaf, {key: value}, "leaf."), key)
    assert out == got and type(out) is type(got)


# -- the YAML file's shape --------------------------------------------------------------------
@pytest.mark.parametrize("text,kind", [("- steps: 3\n- seed: 1\n", "list"), ("3\n", "int"),
                                       ("just words\n", "str")])
def test_yaml_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = _yaml(tmp_path, text)
    with pytest.raises(ValueError, match=rf"config file {path}: the top level must be a "
                                         rf"mapping of config keys .*got {kind}"):
        load_config("tiny3", path)


def test_unreadable_config_file_is_named(tmp_path):
    """A --config path that is missing or a folder: an error saying it is the config file."""
    for path in (tmp_path / "missing.yaml", tmp_path):
        with pytest.raises(ValueError, match=rf"^config file {path}: cannot read it: "):
            load_config("tiny3", str(path))


# -- errors inside an agent name it ------------------------------------------------------------
def test_errors_inside_an_agent_name_it(tmp_path):
    with pytest.raises(ValueError, match=r"^agent 'char' \(agents.0\): optim.lr must be a "
                                         r"finite number > 0, got -1.0$"):
        load_config("tiny3", overrides={"agents.0.optim.lr": "-1"})
    with pytest.raises(ValueError, match=r"^agent 'llama' \(agents.2\): warmup.batch_size"):
        load_config("tiny3", overrides={"agents.2.warmup.batch_size": "0"})
    with pytest.raises(ValueError, match=r"^agent 'b' \(agents.1\): optim.lr must be"):
        load_config("tiny3", _yaml(tmp_path, "agents:\n  - {policy: {name: a}}\n"
                                             "  - {policy: {name: b}, optim: {lr: 0}}\n"))
    # a decoder policy's shape, checked as the config loads (not when the model is built)
    with pytest.raises(ValueError, match=r"^agent 'qwen3': policy: d_model=32 is not divisible "
                                         r"by n_heads=3$"):
        load_config("tiny3", overrides={"agents.1.policy.n_heads": "3"})
    with pytest.raises(ValueError, match=r"^agent 'char': policy: head dim must be even for "
                                         r"rotary embeddings \(d_model=12, n_heads=4\)$"):
        load_config("tiny3", overrides={"agents.0.policy.d_model": "12",
                                        "agents.0.policy.n_heads": "4"})
    with pytest.raises(ValueError, match=r"^agent 'char': policy.n_heads must be an integer "
                                         r">= 1, got 0$"):
        load_config("tiny3", overrides={"agents.0.policy.n_heads": "0"})


# -- settings nothing would use ----------------------------------------------------------------
def test_hf_settings_on_a_decoder_policy_are_an_error():
    """hf_config / arch / path configure an HF model (policy.kind='hf'); a decoder policy would
    ignore them, so setting them is an error naming them, like parallel.* on a torch agent."""
    with pytest.raises(ValueError, match=r"agent 'char': policy.hf_config=\{'hidden_size': 32\} "
                                         r"only applies to policy.kind='hf', but this agent "
                                         r"has policy.kind='decoder'"):
        load_config("tiny3", overrides={"agents.0.policy.hf_config": "{hidden_size: 32}"})
    with pytest.raises(ValueError, match=r"agent 'qwen3': policy.arch='qwen2', "
                                         r"policy.path='m' only apply to policy.kind='hf'"):
        load_config("tiny3", overrides={"agents.1.policy.arch": "qwen2",
                                        "agents.1.policy.path": "m"})
    hf = load_config("tiny3", overrides={"agents.0.policy.kind": "hf",
                                         "agents.0.policy.hf_config": "{hidden_size: 32}"})
    assert hf.agents[0].policy.hf_config == {"hidden_size": 32}
    # a model loaded from policy.path brings its own config: hf_config would be ignored
    with pytest.raises(ValueError, match=r"agent 'char': policy.hf_config=\{'hidden_size': 32\} "
                                         r"only applies to a model built from policy.arch, but "
                                         r"policy.path='ckpt' loads one"):
        hf.override({"agents.0.policy.path": "ckpt"})


def test_a_yaml_agent_without_a_section_takes_a_dotted_override(tmp_path):
    """YAML agents given without their optim section, then --set agents.0.optim.lr: the
    section is filled in (it was a bare KeyError: "hacpo train: error: optim")."""
    path = _yaml(tmp_path, "agents: [{policy: {name: a}}]\n")
    cfg = load_config("tiny3", path, {"agents.0.optim.lr": "3e-4"})
    assert len(cfg.agents) == 1 and cfg.agents[0].policy.name == "a"
    assert cfg.agents[0].optim.lr == 3e-4 and cfg.agents[0].optim.beta1 == 0.9


def test_decoder_sizes_given_for_an_hf_policy_are_an_error(tmp_path):
    """d_model / n_layers / n_heads / max_len size the plain decoder only; an HF model's sizes
    come from its transformers config. One the user gives for a kind='hf' policy (--set, a YAML
    mapping by index or a YAML agents list) is an error naming it; the preset's decoder sizes
    a policy keeps when only its kind changes, and a saved config.json replayed as --config
    (every field written, whichever the kind uses), are not."""
    msg = (r"^agent 'char': agents\.0\.policy\.d_model=512 applies to policy\.kind='decoder' "
           r"only, but this agent has policy\.kind='hf', whose sizes come from its model "
           r"config .*hf_config\.hidden_size.*: remove it$")
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", overrides={"agents.0.policy.kind": "hf",
                                        "agents.0.policy.d_model": "512"})
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", _yaml(tmp_path, "agents:\n  0: {policy: {kind: hf, d_model: 512}}"))
    with pytest.raises(ValueError, match=r"^agent 'h': agents\.0\.policy\.n_layers=3, "
                                         r"agents\.0\.policy\.max_len=64 apply to "
                                         r"policy\.kind='decoder' only.*: remove them$"):
        load_config("tiny3", _yaml(tmp_path, "agents:\n  - policy: {name: h, kind: hf, "
                                             "n_layers: 3, max_len: 64}\n"))
    # the YAML sets the size, --set makes the policy HF: checked as the two give it together
    with pytest.raises(ValueError, match=r"agents\.0\.policy\.n_heads=8 applies to "
                                         r"policy\.kind='decoder' only"):
        load_config("tiny3", _yaml(tmp_path, "agents:\n  0: {policy: {n_heads: 8}}"),
                    {"agents.0.policy.kind": "hf"})
    # only the kind changes: the preset's decoder sizes stay (unused), no error
    hf = load_config("tiny3", overrides={"agents.0.policy.kind": "hf"})
    assert (hf.agents[0].policy.kind, hf.agents[0].policy.d_model) == ("hf", 32)
    # a decoder's sizes are its own; an HF policy switched to decoder takes them
    assert load_config("tiny3", overrides={"agents.0.policy.d_model": "64"}
                       ).agents[0].policy.d_model == 64
    assert hf.override({"agents.0.policy.kind": "decoder", "agents.0.policy.d_model": "64"}
                       ).agents[0].policy.d_model == 64
    # a run's saved config.json (an HF agent with the decoder sizes carried along) replays
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(hf.to_dict()))
    assert load_config("tiny3", str(saved)) == hf
    # ... but a size given on top of it is the user's
    with pytest.raises(ValueError, match=r"agents\.0\.policy\.max_len=99 applies to "
                                         r"policy\.kind='decoder' only"):
        load_config("tiny3", str(saved), {"agents.0.policy.max_len": "99"})
    # the reverse: an HF setting on a decoder differing from its default is an error
    # (test_hf_settings_on_a_decoder_policy_are_an_error); set to its default it clears it
    assert load_config("tiny3", str(saved), {"agents.0.policy.kind": "decoder",
                                             "agents.0.policy.arch": "llama"}
                       ).agents[0].policy.kind == "decoder"


def test_hf_config_keys_and_arch_are_checked_when_the_config_loads():
    """A misspelt policy.hf_config key, or an unknown policy.arch, is an error when the config
    loads (hacpo train before any data or warm-up, the launchers' dry runs), with
    build_hf_model's message and the agent's name."""
    base = {"agents.0.policy.kind": "hf"}
    with pytest.raises(ValueError, match=r"^agent 'char': policy\.hf_config: HF llama config: "
                                         r"unknown key\(s\) \['hiden_size'\] \(not fields of "
                                         r"LlamaConfig; a misspelling would build the default "
                                         r"model\)$"):
        load_config("tiny3", overrides={**base, "agents.0.policy.hf_config":
                                        "{hiden_size: 32, num_hidden_layers: 1}"})
    with pytest.raises(ValueError, match=r"HF gpt2 config: unknown key\(s\) \['n_embed'\]"):
        load_config("tiny3", overrides={**base, "agents.0.policy.arch": "gpt2",
                                        "agents.0.policy.hf_config": "{n_embed: 32}"})
    with pytest.raises(ValueError, match=r"^agent 'char': policy\.arch: unknown HF "
                                         r"architecture 'mamba'; supported: \['gpt2', "
                                         r"'llama', 'qwen2'\]$"):
        load_config("tiny3", overrides={**base, "agents.0.policy.arch": "mamba"})
    # the values too, as transformers checks them when the model is built
    with pytest.raises(ValueError, match=r"^agent 'char': policy\.hf_config=\{'hidden_size': "
                                         r"30\} is no valid LlamaConfig: .*hidden size \(30\) "
                                         r"is not a multiple of the number of attention heads"):
        load_config("tiny3", overrides={**base, "agents.0.policy.hf_config": "{hidden_size: 30}"})
    with pytest.raises(ValueError, match=r"is no valid LlamaConfig: .*'hidden_size' expected "
                                         r"int, got str"):
        load_config("tiny3", overrides={**base, "agents.0.policy.hf_config": "{hidden_size: x}"})
    with pytest.raises(ValueError, match=r"^agent 'char': policy\.hf_config: keys must be "
                                         r"strings \(config field names\), got \[1\]$"):
        load_config("tiny3", overrides={**base, "agents.0.policy.hf_config": "{1: 2}"})
    # fields of the config (and keys the config consumes, e.g. rope_theta) load
    ok = load_config("tiny3", overrides={**base, "agents.0.policy.arch": "qwen2",
                                         "agents.0.policy.hf_config":
                                         "{hidden_size: 32, num_attention_heads: 2, "
                                         "rope_theta: 5000.0}"})
    assert ok.agents[0].policy.hf_config["rope_theta"] == 5000.0


@pytest.mark.parametrize("name, why, new_run_only", [
    ("", "needs a non-empty name", False), ("a/b", "may not contain '/'", False),
    ("x/../../evil", "may not contain '/'", False), ("..", "may not be '.' or '..'", False),
    ("a\\b", "may not contain '\\\\'", False), ("a->b", "may not contain '->'", True),
    ("x y", "may not contain ' '", True), ("t\tab", "may not contain '\\t'", True)])
def test_agent_names_that_would_break_files_or_metric_keys_are_refused(name, why,
                                                                      new_run_only):
    # names name the warm-start cache file and metric keys: '/' made subfolders (and could
    # write outside cache_dir), '' gave 'train//loss', '->' broke 'omega/s->t'. Whitespace and
    # '->' only for new runs: a stored run with such a name still resumes and evaluates
    from hacpo.engine.run_config import check_new_run_names, load_config
    pattern = r"agents\.0\.policy\.name=.*" + re.escape(why)
    if new_run_only:
        cfg = load_config("tiny3", overrides={"agents.0.policy.name": name})
        with pytest.raises(ValueError, match=pattern):
            check_new_run_names(cfg)
    else:
        with pytest.raises(ValueError, match=pattern):
            load_config("tiny3", overrides={"agents.0.policy.name": name})
    check_new_run_names(load_config("tiny3", overrides={"agents.0.policy.name": "qwen2.5_v2"}))


def test_a_stored_run_with_a_name_new_runs_may_not_use_still_evaluates_and_resumes(
        tmp_path, monkeypatch):
    from hacpo.engine import checkpoint as ckpt
    from hacpo.engine import trainer
    from hacpo.engine.eval_harness import eval_config
    from hacpo.engine.run_config import load_config
    cfg = load_config("tiny3", overrides={
        "agents.0.policy.name": "my agent", "out_dir": str(tmp_path / "run"),
        "cache_dir": str(tmp_path / "cache"), "threads": 1, "steps": 0, "plots": False,
        "tensorboard": False})
    with pytest.raises(ValueError, match=r"may not contain ' '"):
        trainer.train(cfg, echo=lambda *_: None)
    ck = tmp_path / "run" / "checkpoint.pt"
    assert not ck.exists()
    with monkeypatch.context() as m:         # a run an older version started
        m.setattr(trainer, "check_new_run_names", lambda cfg: None)
        trainer.train(cfg, echo=lambda *_: None)
    assert ckpt.load(str(ck))["step"] == 0
    trainer.train(cfg.override({"steps": 1}), resume=True, echo=lambda *_: None)
    assert ckpt.load(str(ck))["step"] == 1
    got, _ = eval_config(ckpt.load(str(ck))["config"])
    assert got.agents[0].policy.name == "my agent"


def test_a_key_under_a_mapping_says_how_to_set_the_mapping():
    """--set agents.0.policy.hf_config.hidden_size=64 said "'hf_config' has no sub-keys" (it
    holds keys, set as one mapping); a key under a plain value still has none."""
    with pytest.raises(ValueError, match=r"agents.0.policy.hf_config is a mapping set as a "
                                         r"whole, e.g. agents.0.policy.hf_config="
                                         r"'\{hidden_size: 64\}'"):
        load_config("tiny3", overrides={"agents.0.policy.hf_config.hidden_size": "64"})
    cfg = load_config("tiny3", overrides={"agents.0.policy.kind": "hf",
                                          "agents.0.policy.hf_config": "{hidden_size: 64}"})
    assert cfg.agents[0].policy.hf_config == {"hidden_size": 64}
    with pytest.raises(ValueError, match=r"unknown config key 'steps.x': 'steps' has no sub-keys"):
        load_config("tiny3", overrides={"steps.x": "1"})
