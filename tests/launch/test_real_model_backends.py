"""The real pretrained model's backends: what they need of a model, checked before anything
starts.

vLLM's tensor parallelism (``rollout.engine_tp``) splits the served vocabulary, padded to a
multiple of 64, over its workers. SmolLM2-135M-Instruct (9 heads, 3 KV heads, 49152 ids) splits
at engine_tp=3; a second agent with the character tokenizer (91 ids, padded to 128) does not,
and vLLM failed inside its worker processes at engine start (``AssertionError: 128 is not
divisible by 3``), after a megatron group had started, with an engine error that did not name
the cause. ``check_engine_tp`` now refuses it before any engine starts, naming agent and
vocabulary; the rule is checked against vLLM's own vocabulary split (in .venv-vllm).
"""
import json
import subprocess

import pytest

from hacpo.engine.run_config import AgentConfig, RolloutConfig, TrainConfig
from hacpo.launch import vllm_rollout
from hacpo.models.policy import PolicyConfig, build_policy

# 6 heads of 64 (what vLLM's CPU attention serves), 6 KV heads: the heads split at 2, 3 and 6
HF6 = {"hidden_size": 384, "intermediate_size": 384, "num_hidden_layers": 1,
       "num_attention_heads": 6, "num_key_value_heads": 6, "max_position_embeddings": 128}


def _char_policy():
    return build_policy(PolicyConfig(name="char-hf", kind="hf", arch="llama", tokenizer="char",
                                     hf_config=HF6, seed=1))


def test_engine_tp_refuses_a_vocabulary_vllm_cannot_split():
    pol = _char_policy()
    assert pol.tokenizer.vocab_size == 91
    msg = (r"rollout.engine_tp=3: agent 0 \('char-hf'\) has a vocabulary of 91 ids, which vLLM "
           r"pads to 128 rows .*\(128 is not divisible by 3\)")
    with pytest.raises(ValueError, match=msg):
        vllm_rollout.check_engine_tp([pol], 3)
    # the engine pool refuses it before it starts anything (no Ray, no vLLM Python probed)
    cfg = TrainConfig(agents=[AgentConfig(policy=PolicyConfig(name="char-hf", kind="hf"))],
                      rollout=RolloutConfig(engine="vllm", engine_tp=3), seed=0, threads=1)
    with pytest.raises(ValueError, match=msg):
        vllm_rollout.VLLMRolloutEngine([pol], cfg, python="/nonexistent/python")
    # ... and at 6 (its heads split, its vocabulary not); the same model splits at 1 and 2
    # (128 rows: 64 each)
    with pytest.raises(ValueError, match=r"\(128 is not divisible by 6\)"):
        vllm_rollout.check_engine_tp([pol], 6)
    for tp in (1, 2):
        vllm_rollout.check_engine_tp([pol], tp)


@pytest.mark.parametrize("vocab,tp,ok", [(91, 3, False), (91, 2, True), (192, 3, True),
                                         (193, 3, False), (49152, 3, True), (151936, 3, False),
                                         (151936, 4, True), (128256, 5, False),
                                         (562, 5, False), (640, 5, True)])
def test_vocabulary_rule(vocab, tp, ok):
    assert (vllm_rollout.engine_vocab_problem(vocab, tp) is None) == ok


def test_vocabulary_rule_is_vllms_own():
    """vLLM's VocabParallelEmbedding arithmetic (its padding, its split of the padded rows over
    the workers), run in the vLLM venv: it fails exactly where engine_vocab_problem says."""
    cases = [(v, tp) for v in (91, 128, 192, 193, 562, 49152, 151936, 128256)
             for tp in (2, 3, 4, 5, 6)]
    probe = ("import json, sys\n"
             "from vllm.model_executor.layers.vocab_parallel_embedding import (\n"
             "    VocabParallelEmbedding, pad_vocab_size)\n"
             "out = []\n"
             "for v, tp in json.loads(sys.argv[1]):\n"
             "    p = pad_vocab_size(v)\n"
             "    try:\n"
             "        for r in range(tp):\n"
             "            VocabParallelEmbedding._get_indices(p, p, v, v, r, tp)\n"
             "        out.append(True)\n"
             "    except AssertionError:\n"
             "        out.append(False)\n"
             "print(json.dumps(out))\n")
    done = subprocess.run([vllm_rollout.vllm_python(), "-c", probe, json.dumps(cases)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    vllm_ok = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [vllm_rollout.engine_vocab_problem(v, tp) is None for v, tp in cases]
    assert ours == vllm_ok, [c for c, a, b in zip(cases, ours, vllm_ok) if a != b]
    assert not all(vllm_ok) and any(vllm_ok)      # both outcomes occur


@pytest.mark.slow
def test_smollm2_splits_at_engine_tp_3(smollm2_dir):
    """The real model passes the check at engine_tp=3 (9 heads, 3 KV heads, 49152 ids); next to
    the character-tokenizer agent the pool names that agent (index 1), not SmolLM2."""
    smol = build_policy(PolicyConfig(name="smollm2", kind="hf", path=smollm2_dir,
                                     tokenizer=smollm2_dir))
    assert smol.tokenizer.vocab_size == 49152
    vllm_rollout.check_engine_tp([smol], 3)
    with pytest.raises(ValueError, match=r"agent 1 \('char-hf'\) has a vocabulary of 91 ids"):
        vllm_rollout.check_engine_tp([smol, _char_policy()], 3)


def test_train_refuses_it_as_a_config_error_before_any_engine(tmp_path):
    """`hacpo train` checks it with the run's inputs (one error line, exit status 2), before
    the warm-up and before any trainer group or engine starts (it was a traceback from the
    engine pool, built after the megatron groups)."""
    from hacpo.engine.errors import is_user_error
    from hacpo.engine.trainer import train
    cfg = TrainConfig(agents=[AgentConfig(policy=PolicyConfig(
        name="char-hf", kind="hf", arch="llama", tokenizer="char",
        hf_config={**HF6, "max_position_embeddings": 256}, seed=1))],
        rollout=RolloutConfig(engine="vllm", engine_tp=3), seed=0, threads=1,
        out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), plots=False,
        tensorboard=False, progress=False)
    said = []
    with pytest.raises(ValueError, match=r"rollout.engine_tp=3: agent 0 \('char-hf'\) has a "
                                         r"vocabulary of 91 ids") as e:
        train(cfg, echo=said.append)
    assert is_user_error(e.value)
    assert not any("warm-up" in s for s in said), said
