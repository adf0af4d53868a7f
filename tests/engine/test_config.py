"""Algorithm config: presets, overrides, validation errors."""
import json
import math

import pytest

from hacpo.engine import AlgorithmConfig, available_presets, preset
from hacpo.engine import defaults as D


def test_presets():
    h = preset("hacpo")
    assert h == AlgorithmConfig()
    assert (h.loss.cross_clip_delta, h.loss.cross_clip_step, h.loss.alpha) == (0.2, 0.025, 1.0)
    assert (h.capability.window, h.capability.ratio_min, h.capability.ratio_max) == (5, 0.1, 10.0)
    assert (h.loss.self_clip_low, h.loss.self_clip_high) == (3e-4, 4e-4)
    assert preset("hacpo-table5").loss.cross_clip_delta == 0.8
    assert preset("gspo2x").samples_per_prompt_factor == 2
    assert preset("gspo2x").minibatch_factor == 2
    assert preset("naive").shares_samples and not preset("gspo").shares_samples
    assert preset("grpo").token_level
    assert preset("hacpo-alpha0").loss.alpha == 0.0
    assert preset("hacpo-no-cross-clip").loss.cross_clip == "none"
    assert not preset("hacpo-no-capability-baseline").advantage.capability_baseline
    assert not preset("hacpo-no-capability-coefficient").loss.capability_coefficient
    assert preset("hacpo-source-baseline").advantage.cross_baseline == "source"
    assert set(available_presets()) >= {"grpo", "gspo", "gspo2x", "naive", "hacpo",
                                        "hacpo-table5"}


def test_defaults_defined_once():
    assert AlgorithmConfig().loss.cross_clip_delta is D.CROSS_CLIP_DELTA
    import inspect
    from hacpo.engine import hacpo_policy_loss
    sig = inspect.signature(hacpo_policy_loss)
    assert sig.parameters["cross_clip_delta"].default is D.CROSS_CLIP_DELTA


def test_overrides_parse_strings_and_roundtrip():
    c = preset("hacpo", {"loss.alpha": "0.5", "advantage.binary_guard": "false",
                         "capability.window": "3", "name": "naive"})
    assert c.loss.alpha == 0.5 and c.advantage.binary_guard is False
    assert c.capability.window == 3 and c.name == "naive"
    assert AlgorithmConfig.from_dict(c.to_dict()) == c


def test_optional_fields_parse_from_strings():
    """``X | None`` fields (e.g. --set rollout.gpu_memory_utilization=0.7 on the command line,
    where every value is a string) parse to X, and "none" / "null" to None."""
    from hacpo.engine.run_config import load_config
    cfg = load_config("tiny3", overrides={"rollout.engine": "vllm", "rollout.device": "cuda"})
    got = cfg.override({"rollout.gpu_memory_utilization": "0.7", "data.task": "files",
                        "data.train_path": "a.jsonl", "data.eval_size": "0"})
    assert got.rollout.gpu_memory_utilization == 0.7 and got.data.train_path == "a.jsonl"
    assert got.rollout.engine_memory_fraction() == 0.7
    back = got.override({"rollout.gpu_memory_utilization": "none", "data.train_path": "null",
                         "data.task": "arithmetic"})
    assert back.rollout.gpu_memory_utilization is None and back.data.train_path is None
    with pytest.raises(ValueError, match=r"cannot parse 'most' as float"):
        cfg.override({"rollout.gpu_memory_utilization": "most"})


@pytest.mark.parametrize("overrides,match", [
    ({"name": "ppo"}, "unknown algorithm 'ppo'"),
    ({"loss.alpha": -0.1}, "alpha must be finite and >= 0"),
    # infinite values: every advantage 0 (eps), a NaN loss (alpha, kl_coef), no bound on the
    # exponentiated log-ratio, a stepwise bound of 1 - delta + 0 * inf = NaN; a capability
    # floor of 1 or more: every agent's capability the floor, every ratio 1
    ({"advantage.eps": math.inf}, r"advantage.eps must be finite and > 0"),
    ({"loss.alpha": math.inf}, r"loss.alpha must be finite and >= 0, got inf"),
    ({"loss.kl_coef": math.inf}, r"loss.kl_coef must be finite and >= 0, got inf"),
    ({"loss.max_abs_log_ratio": math.inf}, r"loss.max_abs_log_ratio must be finite and > 0"),
    ({"loss.cross_clip_step": math.inf}, r"loss.cross_clip_step must be finite and >= 0"),
    ({"capability.minimum": 5.0}, r"capability.minimum must be in \(0, 1\)"),
    ({"capability.minimum": 1.0}, r"capability.minimum must be in \(0, 1\)"),
    ({"capability.minimum": math.inf}, r"capability.minimum must be in \(0, 1\)"),
    ({"capability.ratio_min": math.inf, "capability.ratio_max": math.inf},
     r"capability.ratio_min must be finite and >= 1.175e-38"),
    ({"loss.cross_clip_delta": 1.2}, r"cross_clip_delta must be in \[0, 1\]"),
    ({"loss.cross_clip_delta": -0.1}, r"cross_clip_delta must be in \[0, 1\]"),
    ({"capability.window": 0}, "window must be an integer >= 1"),
    ({"capability.ratio_min": 20.0}, "ratio_min .* must be <= ratio_max"),
    # a range without 1 clamps an agent's ratio to itself: its own samples reweighted
    ({"capability.ratio_min": 2.0}, r"ratio_min \(2.0\) must be <= 1 <= ratio_max"),
    ({"capability.ratio_max": 0.5}, r"must be <= 1 <= ratio_max \(0.5\)"),
    ({"loss.cross_clip": "soft"}, "cross_clip 'soft' unknown"),
    ({"loss.gamma": 1}, "unknown config key 'loss.gamma'"),
    ({"capability.window": "five"}, "cannot parse 'five' as int"),
    ({"loss": 3}, "is a section"),
])
def test_bad_values_raise_clear_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        preset("hacpo", overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown algorithm preset 'hacpo2'"):
        preset("hacpo2")


def test_config_diff_ignores_fields_added_after_a_checkpoint_at_their_default():
    from hacpo.engine.run_config import (config_diff, default_fingerprint, fingerprint_dict,
                                         load_config)
    cfg = load_config("tiny3")
    new = fingerprint_dict(cfg)
    old = json.loads(json.dumps(new))          # a checkpoint written before two fields existed
    del old["rollout"]["engine"]
    del old["agents"][1]["optim"]["beta2"]
    assert config_diff(old, new) == ["agents.1.optim.beta2", "rollout.engine"]
    defaults = default_fingerprint(cfg)
    assert config_diff(old, new, defaults=defaults) == []
    # a new field set to a non-default value is a difference; so is any changed value
    new2 = fingerprint_dict(cfg.override({"rollout.engine": "ray", "seed": 5}))
    assert config_diff(old, new2, defaults=defaults) == ["rollout.engine", "seed"]


def test_weight_bucket_sizes_are_resumable_and_validated():
    """How weights move (rollout / megatron bucket sizes) and how megatron computes log-probs
    (parallel.lm_head, policy.lm_head) and how megatron cuts micro-batches
    (parallel.micro_batch_tokens, parallel.sequence_parallel, parallel.recompute*) may change
    on resumption, like time limits, and so may the megatron layout's tp / pp / dp; the
    vocabulary padding and the distributed optimizer (whose state differs) may not. Non-positive sizes and an unknown lm_head are clear errors."""
    from hacpo.engine.run_config import config_diff, fingerprint_dict, load_config
    # agent 0 as a megatron trainer group (an HF Llama), the only kind parallel.* applies to
    cfg = load_config("tiny3", overrides={
        "agents.0.policy.kind": "hf", "agents.0.policy.arch": "llama",
        "agents.0.trainer": "megatron", "trainer_backend": "ray"})
    a = fingerprint_dict(cfg)
    b = fingerprint_dict(cfg.override({"rollout.weight_bucket_mb": 8,
                                       "agents.0.parallel.weight_bucket_mb": 0.5,
                                       "agents.0.parallel.lm_head": "logits",
                                       "agents.0.parallel.micro_batch_tokens": 4096,
                                       "agents.1.policy.lm_head": "fused"}))
    assert config_diff(a, b) == []
    # sequence parallelism: a way to lay out activations, not the math (at tp > 1 only)
    tp2 = cfg.override({"agents.0.parallel.tp": 2})
    assert config_diff(fingerprint_dict(tp2), fingerprint_dict(tp2.override(
        {"agents.0.parallel.sequence_parallel": True}))) == []
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel needs tensor "
                                         r"parallelism \(tp > 1\), got tp=1"):
        cfg.override({"agents.0.parallel.sequence_parallel": True})
    # activation recomputation: the same gradients, so resumable too; bad values: clear errors
    assert config_diff(a, fingerprint_dict(cfg.override({
        "agents.0.parallel.recompute": "selective",
        "agents.0.parallel.recompute_modules": "mlp,core_attn"}))) == []
    assert cfg.override({"agents.0.parallel.recompute": "full",
                         "agents.0.parallel.recompute_num_layers": 2}).agents[0] \
        .parallel.recompute_kwargs() == {"recompute": "full", "modules": ["core_attn"],
                                         "num_layers": 2}
    for key, bad, msg in (
            ("recompute", "all", r"parallel.recompute must be one of none, selective, full, "
                                 r"got 'all'"),
            ("recompute_modules", "core_attn,layernorm",
             r"parallel.recompute_modules must be distinct names from core_attn, mlp, got "
             r"core_attn,layernorm"),
            ("recompute_modules", "mlp,mlp", r"distinct names .* got mlp,mlp"),
            ("recompute_num_layers", 0, r"parallel.recompute_num_layers must be an integer "
                                        r">= 1, got 0")):
        with pytest.raises(ValueError, match=msg):
            cfg.override({f"agents.0.parallel.{key}": bad})
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel must be true or false, "
                                         r"got 2"):
        tp2.override({"agents.0.parallel.sequence_parallel": 2})
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"parallel.micro_batch_tokens must be an integer "
                                             rf">= 0 \(0: micro-batches of micro_batch rows\), "
                                             rf"got {bad}"):
            cfg.override({"agents.0.parallel.micro_batch_tokens": bad})
    with pytest.raises(ValueError, match=r"policy.lm_head must be one of logits, fused, got "
                                         r"'full'"):
        cfg.override({"agents.1.policy.lm_head": "full"})
    with pytest.raises(ValueError, match=r"parallel.lm_head must be one of logits, fused, got "
                                         r"'full'"):
        cfg.override({"agents.0.parallel.lm_head": "full"})
    # the layout's tp / pp / dp and optimizer kind may change (the trainer moves the
    # optimizer state), the vocabulary padding may not
    assert config_diff(a, fingerprint_dict(cfg.override({"agents.0.parallel.tp": 2,
                                                         "agents.0.parallel.pp": 2,
                                                         "agents.0.parallel.dp": 2}))) == []
    c = fingerprint_dict(cfg.override({"agents.0.parallel.make_vocab_size_divisible_by": 8}))
    assert config_diff(a, c) == ["agents.0.parallel.make_vocab_size_divisible_by"]
    dp2 = cfg.override({"agents.0.parallel.dp": 2})
    assert config_diff(fingerprint_dict(dp2), fingerprint_dict(dp2.override(
        {"agents.0.parallel.distributed_optimizer": True}))) == []
    with pytest.raises(ValueError, match=r"parallel.distributed_optimizer must be true or "
                                         r"false, got 2"):
        dp2.override({"agents.0.parallel.distributed_optimizer": 2})
    for key, name in (("rollout.weight_bucket_mb", "rollout.weight_bucket_mb"),
                      ("agents.0.parallel.weight_bucket_mb", "parallel.weight_bucket_mb")):
        for bad in (0, -1.0, float("nan")):
            with pytest.raises(ValueError, match=rf"{name} must be a number > 0, got {bad}"):
                cfg.override({key: bad})


def test_parallel_settings_on_a_torch_agent_are_an_error():
    """parallel.* configures a megatron trainer group; on a trainer=torch agent nothing would
    use it, so setting it is a clear error naming what was set (never silently ignored)."""
    from hacpo.engine.run_config import load_config
    cfg = load_config("tiny3")
    assert cfg.agents[1].trainer == "torch"
    with pytest.raises(ValueError, match=r"agent 'qwen3': parallel.tp=2, "
                                         r"parallel.micro_batch_tokens=64 only apply to "
                                         r"trainer=megatron, but this agent has "
                                         r"trainer='torch'"):
        cfg.override({"agents.1.parallel.tp": 2, "agents.1.parallel.micro_batch_tokens": 64})
    with pytest.raises(ValueError, match=r"parallel.lm_head='logits' only apply"):
        cfg.override({"agents.1.parallel.lm_head": "logits"})


def test_megatron_device_is_resumable_and_transformer_engine_needs_cuda():
    """A megatron group's parallel.device may change on --resume (checkpoints are read onto the
    host; each rank moves its share to its device), as tp / pp / dp may; transformer_impl may
    not. transformer_engine is CUDA-only: asking for it on parallel.device=cpu is an error
    naming both settings when the config loads, not a traceback from every rank."""
    from hacpo.engine.run_config import config_diff, fingerprint_dict, load_config
    cfg = load_config("tiny3", overrides={
        "agents.0.policy.kind": "hf", "agents.0.policy.arch": "llama",
        "agents.0.trainer": "megatron", "trainer_backend": "ray"})
    cuda = cfg.override({"agents.0.parallel.device": "cuda", "agents.0.parallel.tp": 2})
    assert config_diff(fingerprint_dict(cfg), fingerprint_dict(cuda)) == []
    assert config_diff(fingerprint_dict(cuda), fingerprint_dict(cfg)) == []
    te = cuda.override({"agents.0.parallel.transformer_impl": "transformer_engine"})
    assert config_diff(fingerprint_dict(cuda), fingerprint_dict(te)) == [
        "agents.0.parallel.transformer_impl"]
    with pytest.raises(ValueError, match=r"^agent 'char' \(trainer=megatron\): parallel."
                                         r"transformer_impl='transformer_engine' runs on CUDA "
                                         r"only, but parallel.device='cpu': set parallel.device="
                                         r"cuda or parallel.transformer_impl=local$"):
        cfg.override({"agents.0.parallel.transformer_impl": "transformer_engine"})
    with pytest.raises(ValueError, match=r"transformer_engine.*parallel.device='cpu'"):
        te.override({"agents.0.parallel.device": "cpu"})


def test_rollout_devices_and_colocation_are_validated():
    """rollout.device / gpu_memory_utilization / colocate: how engines use GPUs, not the math
    (resumable); what cannot run is a clear error naming it."""
    from hacpo.engine.run_config import config_diff, fingerprint_dict, load_config
    cfg = load_config("tiny3", overrides={"rollout.engine": "vllm"})
    for key, bad, msg in (
            ("rollout.device", "tpu", r"unknown rollout.device 'tpu'; choose one of cpu, cuda"),
            ("rollout.gpu_memory_utilization", 0, r"gpu_memory_utilization must be in \(0, 1\], "
                                                  r"got 0"),
            ("rollout.gpu_memory_utilization", 1.5, r"in \(0, 1\], got 1.5"),
            ("rollout.colocate", True, r"rollout.colocate needs rollout.device='cuda'.*no sleep "
                                       r"mode on the CPU"),
            ("rollout.engine_tp", 0, r"rollout.engine_tp must be an integer >= 1, got 0"),
            ("rollout.engine_tp", 1.5, r"rollout.engine_tp must be an integer >= 1, got 1.5")):
        with pytest.raises(ValueError, match=msg):
            cfg.override({key: bad})
    with pytest.raises(ValueError, match=r"rollout.device='cuda' needs rollout.engine='vllm' "
                                         r"\(the 'ray' engine samples on the CPU\)"):
        cfg.override({"rollout.engine": "ray", "rollout.device": "cuda"})
    with pytest.raises(ValueError, match=r"rollout.engine_tp=2 needs rollout.engine='vllm'"):
        cfg.override({"rollout.engine": "local", "rollout.engine_tp": 2})
    assert config_diff(fingerprint_dict(cfg), fingerprint_dict(cfg.override(
        {"rollout.engine_tp": 2}))) == []
    cuda = cfg.override({"rollout.device": "cuda", "rollout.gpu_memory_utilization": 0.5})
    assert config_diff(fingerprint_dict(cfg), fingerprint_dict(cuda)) == []
    # colocated engines share the GPUs of megatron ranks on cuda: every agent needs them
    with pytest.raises(ValueError, match=r"agent 'char' is trainer='torch' with "
                                         r"parallel.device='cpu': every agent needs "
                                         r"trainer=megatron and parallel.device=cuda"):
        cuda.override({"rollout.colocate": True})
    mega = load_config("tiny3", overrides={
        "rollout.engine": "vllm", "rollout.device": "cuda", "trainer_backend": "ray",
        **{f"agents.{k}.{key}": v for k in range(3) for key, v in (
            ("policy.kind", "hf"), ("policy.arch", "llama"), ("trainer", "megatron"),
            ("parallel.device", "cuda"))}})
    with pytest.raises(ValueError, match=r"agent 'llama' is trainer='megatron' with "
                                         r"parallel.device='cpu'"):
        mega.override({"agents.2.parallel.device": "cpu", "rollout.colocate": True})
    colo = mega.override({"rollout.colocate": True})
    assert config_diff(fingerprint_dict(mega), fingerprint_dict(colo)) == []
    # an engine's GPU share: 0.85 alone on its GPU, 0.5 beside a trainer rank, unless set
    assert mega.rollout.engine_memory_fraction() == 0.85
    assert colo.rollout.engine_memory_fraction() == 0.5
    assert colo.override({"rollout.gpu_memory_utilization": 0.7}
                         ).rollout.engine_memory_fraction() == 0.7
    assert mega.override({"rollout.gpu_memory_utilization": 0.7, "rollout.colocate": True}
                         ).rollout.engine_memory_fraction() == 0.7
    with pytest.raises(ValueError, match=r"rollout.colocate places one engine on one trainer "
                                         r"rank's GPU: it needs rollout.engine_tp=1, got 2"):
        colo.override({"rollout.engine_tp": 2})
    with pytest.raises(ValueError, match=r"rollout.engines_per_agent=2 engines cannot share the "
                                         r"GPUs of agent 'char''s 1 trainer ranks"):
        colo.override({"rollout.engines_per_agent": 2})
    dp2 = {f"agents.{k}.parallel.dp": 2 for k in range(3)}
    assert colo.override({**dp2, "rollout.engines_per_agent": 2}).rollout.engines_per_agent == 2


def test_final_eval_pass_k_and_reward_workers_are_resumable():
    """eval_pass_k (the final evaluation only) and reward.num_workers (where rewards run) may
    change on --resume; the reward's timeout and the periodic evaluation's length may not."""
    from hacpo.engine.run_config import config_diff, fingerprint_dict, load_config
    cfg = load_config("tiny3")
    a = fingerprint_dict(cfg)
    assert config_diff(a, fingerprint_dict(cfg.override(
        {"eval_pass_k": 8, "reward.num_workers": 2}))) == []
    assert config_diff(a, fingerprint_dict(cfg.override({"reward.timeout_s": 9}))) != []
    assert config_diff(a, fingerprint_dict(cfg.override({"eval_max_new_tokens": 7}))) != []


def test_keys_that_change_the_math_block_a_resume():
    """Sampling, data, reward, seed, optimizer and algorithm settings are in the resume
    fingerprint: changing any of them is a difference a resume refuses (only keys that do not
    change the math, e.g. steps or threads, may change)."""
    from hacpo.engine.run_config import config_diff, fingerprint_dict, load_config
    cfg = load_config("tiny3")
    a = fingerprint_dict(cfg)
    changes = {"seed": 3, "prompts_per_step": 5, "rollout.temperature": 0.7,
               "rollout.top_p": 0.9, "rollout.group_size": 3, "rollout.max_new_tokens": 9,
               "rollout.engine": "ray", "data.seed": 1, "data.train_size": 150,
               "reward.name": "exact", "algorithm.loss.alpha": 0.5,
               "agents.1.optim.lr": 5e-4, "agents.2.policy.seed": 9,
               "drop_unencodable": False, "max_nonfinite": 2}
    for key, value in changes.items():
        assert config_diff(a, fingerprint_dict(cfg.override({key: value}))) == [key], key
    assert config_diff(a, fingerprint_dict(cfg.override({"steps": 9, "threads": 1}))) == []


def test_the_default_preset_is_the_documented_run():
    """README, "The embedded default": char-small (character tokenizer) and qwen3-large (Qwen3
    BPE, vocabulary reduced to the task), each warmed up for 300 steps, then HACPO: 60 steps of
    64 prompts x G=8, two minibatches, sampled at temperature 0.7, 500 held-out problems."""
    from hacpo.engine.run_config import load_config
    cfg = load_config("default")
    pols = [(a.policy.name, a.policy.tokenizer, a.policy.reduce_vocab, a.warmup.steps)
            for a in cfg.agents]
    assert pols == [("char-small", "char", False, 300), ("qwen3-large", "qwen3", True, 300)]
    assert (cfg.algorithm.name, cfg.algorithm.num_minibatches) == ("hacpo", 2)
    assert (cfg.steps, cfg.prompts_per_step, cfg.rollout.group_size) == (60, 64, 8)
    assert (cfg.rollout.temperature, cfg.data.eval_size, cfg.data.task) == \
        (0.7, 500, "arithmetic")


@pytest.mark.parametrize("text,value", [("1", True), ("true", True), ("Yes", True),
                                        ("on", True), ("0", False), ("false", False),
                                        ("NO", False), ("off", False)])
def test_boolean_spellings_parse(text, value):
    """--set takes a boolean as 1/0, true/false, yes/no or on/off (any case)."""
    from hacpo.engine.run_config import load_config
    cfg = load_config("tiny3", overrides={"progress": text, "drop_unencodable": text})
    assert (cfg.progress, cfg.drop_unencodable) == (value, value)


def test_set_values_may_contain_equals_signs():
    """KEY=VALUE splits at the first '=': a value such as a run dir named after its settings
    keeps its own '='; an item without '=' is an error naming it."""
    from hacpo.engine.configtools import parse_overrides
    assert parse_overrides(["out_dir=runs/lr=3e-4,g=4", " steps = 5 "]) == {
        "out_dir": "runs/lr=3e-4,g=4", "steps": "5"}
    with pytest.raises(ValueError, match="'steps' must look like key=value"):
        parse_overrides(["steps"])


def test_an_agent_index_past_the_list_is_a_clear_error():
    """agents.N with N = the number of agents (one past the last) is a ValueError naming the
    key and the allowed indices, as a larger N is (not an IndexError)."""
    from hacpo.engine.run_config import load_config
    for n in (3, 4):
        with pytest.raises(ValueError, match=rf"config key 'agents.{n}.optim.lr': '{n}' is not "
                                             rf"an index < 3"):
            load_config("tiny3", overrides={f"agents.{n}.optim.lr": "1e-3"})


def test_a_leading_tilde_is_the_home_directory(tmp_path, monkeypatch, capsys):
    """A shell leaves `~` as it is in `--out-dir=~/r`, a quoted word and a YAML value: the
    run made a folder named "~" in the current directory (printing "run dir ~/r", which looks
    like the home one); a data file `~/x.jsonl` "could not be read"."""
    from hacpo.engine.run_config import load_config, resolve_paths
    from hacpo.launch import cli
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "t.jsonl").write_text("")
    cfg = load_config("tiny3", overrides={"out_dir": "~/r1", "cache_dir": "~/cache",
                                          "data.task": "files", "data.train_path": "~/t.jsonl",
                                          "data.eval_path": "~/e.jsonl"})
    assert (cfg.out_dir, cfg.cache_dir) == (str(tmp_path / "home/r1"),
                                            str(tmp_path / "home/cache"))
    pol = load_config("tiny3", overrides={"agents.1.policy.kind": "hf",
                                          "agents.1.policy.path": "~/m",
                                          "agents.1.policy.tokenizer": "~/m"}).agents[1].policy
    assert pol.path == pol.tokenizer == str(tmp_path / "home/m")   # (the early checks read it)
    resolve_paths(cfg)
    assert cfg.data.train_path == str(tmp_path / "home/t.jsonl")
    assert cfg.data.eval_path == str(tmp_path / "home/e.jsonl")     # (missing: as it is)
    for argv, said in ((["export", "~/run", "--out", "~/x"],
                        f"no checkpoint at {tmp_path}/home/run"),
                       (["eval", "~/run", "--bench", "a=~/b.jsonl"],
                        f"benchmark a: no file at {tmp_path}/home/b.jsonl")):
        assert cli.main(argv) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "~").exists()
