"""Folders written by `hacpo export` served by a real vLLM engine the way users serve models
(``LLM(model=folder)``: vLLM's own weight loader, tokenizer and generation config; no hacpo code
in the engine's process): it tokenizes the recorded prompt and the chat template to hacpo's
prompt ids, and its greedy answers and their log-probs are the trained policy's (an HF Qwen2,
and the plain-torch decoder exported as a Llama with the char tokenizer)."""
import dataclasses
import json
import os
import subprocess

import pytest
import torch

from hacpo.engine.export import EXPORT_FILE, export_checkpoint
from hacpo.engine.trainer import train
from hacpo.launch.vllm_rollout import _actor_env, vllm_python
from hacpo.models.generation import generate

from .conftest import HF_TINY, QUESTIONS

pytestmark = pytest.mark.slow

TOL = 2e-3   # as test_vllm_engine.py: float32 on both sides
MAX_NEW = 12

SERVE = r"""
import json, sys
from vllm import LLM, SamplingParams
folder, prompts, questions, max_new = sys.argv[1], json.loads(sys.argv[2]), \
    json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=folder, dtype="float32", enforce_eager=True, seed=0)
params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=0)
out = llm.generate(prompts, params, use_tqdm=False)
chat = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
print("RESULT " + json.dumps({
    "prompt_ids": [list(o.prompt_token_ids) for o in out],
    "ids": [list(o.outputs[0].token_ids) for o in out],
    "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                 for o in out],
    "chat_prompt_ids": [list(o.prompt_token_ids) for o in chat],
    "chat_ids": [list(o.outputs[0].token_ids) for o in chat]}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 1-step run of a tiny HF Qwen2 (the whole Qwen3 tokenizer, head dim 64 as vLLM's CPU
    attention needs) next to tiny3's char agent (its decoder at head dim 64); the checkpoint
    edited so that the Qwen2's greedy answers end with EOS (its tied EOS row set to 3x the row
    of the first question's first greedy token: a random model never picks EOS among 151k
    tokens), then both agents exported."""
    from hacpo.engine import checkpoint as ckpt
    from tests.engine.test_export import _policies, one_step_tiny3
    tmp = tmp_path_factory.mktemp("vllmexport")
    cfg = one_step_tiny3(tmp, **{
        "agents.1.policy.kind": "hf", "agents.1.policy.arch": "qwen2",
        "agents.1.policy.reduce_vocab": False, "agents.1.policy.hf_config": HF_TINY,
        # the char agent's plain-torch decoder, exported as a Llama: head dim 64 too
        "agents.0.policy.d_model": 128, "agents.0.policy.n_heads": 2})
    cfg = dataclasses.replace(cfg, agents=cfg.agents[:2])
    train(cfg, echo=lambda *_: None)
    pol = _policies(tmp / "run")[0]["qwen3"]
    tok = pol.tokenizer
    first = generate(pol, [tok.prompt_ids(QUESTIONS[0])], num_samples=1, max_new_tokens=1,
                     temperature=0.0).response_ids[0][0]
    state = ckpt.load(str(tmp / "run" / "checkpoint.pt"))
    sd = state["agents"][1]["model"]
    emb, head = sd["model.model.embed_tokens.weight"], sd["model.lm_head.weight"]
    assert torch.equal(emb, head)                                          # tied
    emb[tok.eos_id] = head[tok.eos_id] = 3 * emb[first]
    (tmp / "edited").mkdir()
    ckpt.save_atomic(state, str(tmp / "edited" / "checkpoint.pt"))
    dirs = export_checkpoint(str(tmp / "edited"), str(tmp / "hf"), echo=lambda *_: None)
    assert list(dirs) == ["char", "qwen3"]
    return dirs, _policies(tmp / "edited")[0], tmp


@pytest.mark.parametrize("agent", ["qwen3", "char"])
def test_vllm_serves_the_exported_folder(exported, agent):
    """qwen3: the Qwen3 tokenizer's own chat template; char: the plain-torch decoder as a
    Llama, the char tokenizer as a transformers one, hacpo's prompt format (with BOS) as the
    chat template. Greedy answers end with EOS where the policy's do (qwen3: the edited
    checkpoint; char: its warm start)."""
    dirs, pols, tmp = exported
    folder, pol = dirs[agent], pols[agent]
    rec = json.loads(open(os.path.join(folder, EXPORT_FILE)).read())
    texts = [rec["prompt"]["text"].replace(rec["prompt"]["placeholder"], q) for q in QUESTIONS]
    env = {**os.environ, **_actor_env(1, str(tmp))}
    done = subprocess.run([vllm_python(), "-c", SERVE, folder, json.dumps(texts),
                           json.dumps(QUESTIONS), str(MAX_NEW)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(tmp))
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS]
    # vLLM's tokenizer, from the folder: the recorded prompt, and its chat template (the
    # exported tokenizer's own), give hacpo's prompt ids
    assert got["prompt_ids"] == prompts
    assert got["chat_prompt_ids"] == prompts
    ours = generate(pol, prompts, num_samples=1, max_new_tokens=MAX_NEW, temperature=0.0)
    assert got["ids"] == ours.response_ids == got["chat_ids"]
    # vLLM stopped at hacpo's EOS where the policy did (the exported generation config and
    # tokenizer), and ran to the length limit where it did not
    if agent == "qwen3":
        assert ours.finished_eos[0] and ours.response_ids[0][-1] == pol.tokenizer.eos_id
        assert not all(ours.finished_eos), ours.response_ids
    with torch.no_grad():
        lp, mask = pol.response_logprobs(prompts, ours.response_ids)
    for b, row in enumerate(got["logprobs"]):
        torch.testing.assert_close(torch.tensor(row), lp[b, mask[b]], rtol=0, atol=TOL)
    spread = [x for row in got["logprobs"] for x in row]
    assert max(spread) - min(spread) > 0.5       # the tolerance can fail
