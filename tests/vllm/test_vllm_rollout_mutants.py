"""The vLLM rollout engine's module-level checks and helpers, without vLLM or Ray: which
interpreter the engines run (and why one is refused), the config and weights an engine serves,
its actor environment, how prompts are split over engines, and the pool's argument checks."""
import stat
import sys
import types
from importlib.metadata import version

import pytest

from hacpo.launch import vllm_rollout
from hacpo.launch.vllm_rollout import VLLMRolloutEngine

from .conftest import build_policies, tiny_policy_configs, vllm_config


def _script(path, body: str) -> str:
    """A stand-in interpreter: a shell script (what ``vllm_python`` runs with ``-c probe``)."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_installed_package_needs_the_variable(monkeypatch, tmp_path):
    """hacpo installed as a package (no setup.py above it): no default venv, the hint says to
    set $HACPO_VLLM_PYTHON rather than `make vllm-venv`."""
    monkeypatch.setattr(vllm_rollout, "REPO_ROOT", tmp_path)
    monkeypatch.delenv(vllm_rollout.VLLM_PYTHON_ENV, raising=False)
    assert not vllm_rollout.in_repository()
    assert vllm_rollout.build_hint() == vllm_rollout.INSTALLED_HINT
    with pytest.raises(FileNotFoundError, match=r"\$HACPO_VLLM_PYTHON is not set; set "):
        vllm_rollout.find_vllm_python()
    (tmp_path / "setup.py").write_text("")
    assert vllm_rollout.in_repository()
    assert vllm_rollout.build_hint() == vllm_rollout.BUILD_HINT


def test_explicit_python_wins_and_must_be_an_executable_file(monkeypatch, tmp_path):
    ok = _script(tmp_path / "python", "exit 0")
    monkeypatch.setenv(vllm_rollout.VLLM_PYTHON_ENV, str(tmp_path / "missing"))
    assert vllm_rollout.find_vllm_python(ok) == ok            # the argument, then the variable
    plain = tmp_path / "not-executable"
    plain.write_text("")
    for bad in (str(plain), str(tmp_path)):                   # no x bit; a directory
        with pytest.raises(FileNotFoundError, match=rf"no vLLM Python at {bad!r}"):
            vllm_rollout.find_vllm_python(bad)


@pytest.mark.parametrize("out, match", [
    ("echo boom >&2; exit 1", r"does not run: boom; build it with"),
    ("echo {py} {ray} None", r"has no vllm installed"),
    ("echo 3.1 {ray} 0.32.0", r"has Python 3.1 and ray {ray}, but this process has Python "
                              r"{py} and ray {ray}; Ray actors need both to match"),
    ("echo {py} 0.0.1 0.32.0", r"has Python {py} and ray 0.0.1, but this process"),
])
def test_vllm_python_probe_refusals(tmp_path, out, match):
    """The engines' interpreter is probed (no vllm import): one that fails, lacks vllm, or has
    another Python or ray than this process is refused, naming it."""
    fmt = {"py": "%d.%d" % sys.version_info[:2], "ray": version("ray")}
    path = _script(tmp_path / "python", out.format(**fmt))
    with pytest.raises(RuntimeError, match=rf"{path!r} " + match.format(**fmt)):
        vllm_rollout.vllm_python(path)
    good = _script(tmp_path / "good", "echo {py} {ray} 0.32.0".format(**fmt))
    assert vllm_rollout.vllm_python(good) == good


def test_hand_built_policy_without_a_kind_is_refused():
    """A policy-like object with no ``kind`` is named by its type, never taken for "hf"."""
    with pytest.raises(ValueError, match=r"agent 0 \('x'\) is kind 'SimpleNamespace'"):
        vllm_rollout.check_hf_policies([types.SimpleNamespace(name="x")])


def test_engine_tp_error_names_the_agent_that_cannot_split():
    def pol(name, heads, vocab):
        return types.SimpleNamespace(
            name=name, tokenizer=types.SimpleNamespace(vocab_size=vocab),
            model=types.SimpleNamespace(config=types.SimpleNamespace(
                num_attention_heads=heads, num_key_value_heads=heads)))

    with pytest.raises(ValueError, match=r"agent 1 \('b'\) has 4 attention heads"):
        vllm_rollout.check_engine_tp([pol("a", 6, 192), pol("b", 4, 192)], 3)
    with pytest.raises(ValueError, match=r"agent 1 \('b'\) has a vocabulary of 91 ids"):
        vllm_rollout.check_engine_tp([pol("a", 6, 192), pol("b", 6, 91)], 3)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_config_and_shapes_are_what_the_engine_serves(tied):
    """The config vLLM starts from: the model's architecture, untied, the tokenizer's vocabulary
    (a padded table cut), EOS and pad; the policy's own config unchanged. The shapes every load
    is checked against are those of hf_weights (lm_head its own tensor, V rows)."""
    pol, = build_policies(tiny_policy_configs()[:1])
    pol.model.config.tie_word_embeddings = tied
    tok = pol.tokenizer
    V = tok.vocab_size
    pol.model.resize_token_embeddings(V + 5)
    pol.model.config.pad_token_id = pol.model.config.eos_token_id = None   # e.g. a checkpoint's
    own = pol.model.config.to_dict()
    cfg = vllm_rollout.hf_config_dict(pol)
    assert cfg["architectures"] == [type(pol.model).__name__] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["vocab_size"], cfg["eos_token_id"], cfg["pad_token_id"]) == \
        (V, tok.eos_id, tok.pad_id)
    assert tok.eos_id != tok.pad_id
    assert pol.model.config.to_dict() == own                  # a copy was changed
    shapes = vllm_rollout.hf_shapes(pol)
    assert shapes == {n: tuple(t.shape) for n, t in vllm_rollout.hf_weights(pol).items()}
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (V, 128)


def test_actor_env(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    env = vllm_rollout._actor_env(3, None)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"      # engine in the actor's process
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING" and "TMPDIR" not in env
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    env = vllm_rollout._actor_env(1, "/tmp/cluster/vllm")
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG" and env["TMPDIR"] == "/tmp/cluster/vllm"


@pytest.mark.parametrize("n, parts, want", [
    (5, 2, [(0, 3), (3, 5)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (6, 3, [(0, 2), (2, 4), (4, 6)]),
    (2, 4, [(0, 1), (1, 2)]),             # no empty shard
    (1, 0, [(0, 1)]),
])
def test_shards_are_contiguous_and_even(n, parts, want):
    assert vllm_rollout._shards(n, parts) == want


@pytest.mark.parametrize("placement", [[[None, None]], [[None], [None]]])
def test_colocated_engines_need_a_bundle_each(placement):
    """Colocated: one bundle list per agent, each with a bundle per engine (here 2 agents x
    2 engines), else refused before any vLLM Python is probed or Ray starts."""
    configs = tiny_policy_configs()
    policies = build_policies(configs)
    cfg = vllm_config(configs, device="cuda", engines_per_agent=2)
    cfg.rollout.colocate = True
    with pytest.raises(ValueError, match=r"colocate: the engines need their agents' trainer "
                                         r"bundles \(placement\), one per engine"):
        VLLMRolloutEngine(policies, cfg, placement=placement, python="/nonexistent/python")


def test_kv_cache_rounds_up():
    """1.19 GiB (0.95 GiB needed x 1.25) is 2 whole GiB, never 1: vLLM would refuse to start."""
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "hidden_size": 128}
    assert vllm_rollout.kv_cache_gib(tiny, "float32", 1_000_000) == 2


def test_pool_probes_the_python_it_is_given(monkeypatch, tmp_path):
    """``python=`` is the interpreter the pool checks, not $HACPO_VLLM_PYTHON's."""
    configs = tiny_policy_configs()[:1]
    monkeypatch.setenv(vllm_rollout.VLLM_PYTHON_ENV, str(tmp_path / "from-env"))
    given = str(tmp_path / "given")
    with pytest.raises(FileNotFoundError, match=rf"no vLLM Python at {given!r}"):
        VLLMRolloutEngine(build_policies(configs), vllm_config(configs), python=given)


def test_generate_checks_before_any_engine_and_keeps_the_rng_on_failure():
    """A pool without engines (as test_published_weights' stand-in): a temperature vLLM cannot
    serve is refused and max_new_tokens=0 answers empty, neither reaching an engine; a call
    that fails leaves the agent's generator as it was (a retry draws the same seeds)."""
    import torch

    from hacpo.engine.rollout import agent_generators

    pol, = build_policies(tiny_policy_configs()[:1])
    pool = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    pool.policies, pool.generators, pool._closed = [pol], agent_generators(0, 1), False
    calls = []

    def engines(*args):
        calls.append(args)
        raise RuntimeError("engine failed")
    pool._generate = engines
    kw = dict(num_samples=2, max_new_tokens=4, top_p=1.0)
    with pytest.raises(ValueError, match=r"temperature=2.5 cannot be served"):
        pool.generate(0, [[1, 2]], temperature=2.5, **kw)
    out = pool.generate(0, [[1, 2]], temperature=1.0, **{**kw, "max_new_tokens": 0})
    assert out.response_ids == [[], []] and calls == []
    before = pool.generators[0].get_state()
    with pytest.raises(RuntimeError, match="engine failed"):
        pool.generate(0, [[1, 2]], temperature=1.0, **kw)
    assert len(calls) == 1 and torch.equal(pool.generators[0].get_state(), before)


def test_pool_takes_its_settings_from_the_config(monkeypatch, tmp_path):
    """What the pool keeps of the config before any engine starts (stand-ins for the vLLM
    Python probe and the Ray cluster; the first weight upload stops it)."""
    seen = {}

    class Stop(Exception):
        pass

    def put_weights(self, k):
        seen["pool"] = self
        raise Stop

    monkeypatch.setattr(vllm_rollout, "vllm_python", lambda python: "python")
    monkeypatch.setattr(vllm_rollout, "connect", lambda *a, **kw: types.SimpleNamespace(
        owned=False, temp_dir=None, shutdown=lambda: None, require=lambda *a, **kw: None))
    monkeypatch.setattr(VLLMRolloutEngine, "_put_weights", put_weights)
    configs = tiny_policy_configs()[:1]
    cfg = vllm_config(configs, max_engine_restarts=5, call_timeout_s=7.0,
                      gpu_memory_utilization=0.6, engines_per_agent=2, device="cuda")
    cfg.threads, cfg.out_dir = 3, str(tmp_path / "run")
    with pytest.raises(Stop):
        VLLMRolloutEngine(build_policies(configs), cfg)
    pool = seen["pool"]
    assert (pool.threads, pool.run_dir, pool.max_restarts, pool.call_timeout_s) == \
        (3, str(tmp_path / "run"), 5, 7.0)
    assert (pool.gpu_memory_utilization, pool.engines_per_agent) == (0.6, 2)
    assert pool._closed                                       # closed on the failed start
