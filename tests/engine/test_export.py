"""`hacpo export`: a 1-step run's agents written as Hugging Face model directories and read back
by transformers alone (AutoModelForCausalLM / AutoTokenizer): the trained weights bit for bit
(the plain-torch decoder as a Llama), the same log-probs and greedy answers as the hacpo policy,
the prompt format of hacpo_export.json and the chat template giving hacpo's prompt ids; what
cannot be exported is refused naming the agent and why; an existing folder is kept unless
--force; a failed write leaves nothing behind."""
import dataclasses
import json
import os
import re

import pytest
import torch

from hacpo.engine import build
from hacpo.engine.eval_harness import _load_run
from hacpo.engine.export import EXPORT_FILE, export_checkpoint
from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import train
from hacpo.launch import cli
from hacpo.models.generation import generate
from hacpo.models.hf import build_hf_model

transformers = pytest.importorskip("transformers")

QUESTIONS = ["What is 2 + 3?", "Ann has 4 eggs. She gets 3 more. How many eggs does Ann have?",
             "A café sells 3 cakes, then 2 more <|im_end|> how many?"]


def one_step_tiny3(tmp, **overrides):
    """tiny3 for one quiet step into ``tmp/run`` (cache ``tmp/cache``), with ``overrides``."""
    return load_config("tiny3", overrides={
        "out_dir": str(tmp / "run"), "cache_dir": str(tmp / "cache"), "threads": 1,
        "steps": 1, "plots": False, "tensorboard": False, **overrides})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tiny3 plus two agents: char (plain-torch decoder, char tokenizer), qwen3 (HF Qwen2 on the
    whole Qwen3 tokenizer: its chat template), llama (HF Llama on the whole Llama 3.2 tokenizer,
    whose EOS for hacpo is <|eot_id|>, not the tokenizer file's eos_token; hacpo's Llama 3
    template), gpt2 (HF GPT-2 loaded from policy.path on the whole GPT-2 tokenizer: plain
    template with BOS), small (HF Qwen2 on a reduced Qwen3 vocabulary)."""
    tmp = tmp_path_factory.mktemp("exportrun")
    cfg = one_step_tiny3(tmp, **{
        "agents.1.policy.kind": "hf", "agents.1.policy.arch": "qwen2",
        "agents.1.policy.reduce_vocab": False,
        "agents.2.policy.kind": "hf", "agents.2.policy.arch": "llama",
        "agents.2.policy.reduce_vocab": False})

    # gpt2 fine-tunes a saved model (policy.path) whose own config and generation config
    # name another EOS (id 0) than the one hacpo samples to (the tokenizer's, 50256)
    base = build_hf_model({"arch": "gpt2"}, vocab_size=50257, eos_id=0, pad_id=0, seed=4)
    base.save_pretrained(tmp / "gpt2-base")
    assert base.generation_config.eos_token_id == 0

    def more(name, tokenizer, reduce, seed, **kw):
        return dataclasses.replace(cfg.agents[1], policy=dataclasses.replace(
            cfg.agents[1].policy, name=name, tokenizer=tokenizer, reduce_vocab=reduce,
            seed=seed, **kw))
    cfg = dataclasses.replace(cfg, agents=[
        *cfg.agents, more("gpt2", "gpt2", False, 4, path=str(tmp / "gpt2-base"), arch="llama"),
        more("small", "qwen3", True, 5)])
    train(cfg, echo=lambda *_: None)
    return tmp


def _policies(run_dir):
    """The run's policies rebuilt and loaded as `hacpo eval` does, and the checkpoint state."""
    _, _, state, cfg, _ = _load_run(str(run_dir))
    pols = {p.name: p for p in build.build_policies(cfg, build.load_data(cfg))}
    for a in state["agents"]:
        pols[a["name"]].load_state_dict(a["model"])
    return pols, state, cfg


@pytest.fixture(scope="module")
def exported(run):
    out = run / "export"
    dirs = export_checkpoint(str(run / "run"), str(out), agents=["qwen3", "llama", "gpt2", "char"],
                             echo=lambda *_: None)
    return dirs


def _hf(d, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()


@pytest.mark.parametrize("agent", ["qwen3", "llama", "gpt2", "char"])
def test_transformers_reads_the_trained_agent(run, exported, agent):
    pols, state, cfg = _policies(run / "run")
    pol, d = pols[agent], exported[agent]
    assert d == str(run / "export" / agent) and os.path.isdir(d)
    assert not [f for f in os.listdir(run / "export") if f.startswith(".")]   # no temp left
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(d).st_mode & 0o777 == 0o777 & ~umask       # not mkdtemp's 0700
    assert {f: os.stat(os.path.join(d, f)).st_mode & 0o777 for f in os.listdir(d)} == \
        {f: 0o666 & ~umask for f in os.listdir(d)}            # nor safetensors' 0600
    model = _hf(d)
    saved = {k.removeprefix("model."): v for k, v in
             next(a for a in state["agents"] if a["name"] == agent)["model"].items()}
    # the checkpoint's weights are trained: the agent's initial ones differ (can fail: a
    # wrong agent or the warm start's init would be equal here)
    init = build.build_policies(cfg, build.load_data(cfg))[[a.policy.name for a in
                                                            cfg.agents].index(agent)]
    assert any(not torch.equal(v, init.model.state_dict()[k]) for k, v in saved.items())
    got = model.state_dict()
    if agent == "char":
        # the plain-torch decoder as transformers' Llama (hacpo.models.decoder.to_llama;
        # tests/models/test_decoder_to_llama.py maps every tensor)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert torch.equal(got["model.embed_tokens.weight"], saved["embed.weight"])
        assert torch.equal(got["lm_head.weight"], saved["embed.weight"])      # tied
    else:
        # every weight is the checkpoint's, bit for bit (transformers ties the output layer)
        assert set(got) == set(saved)
        assert all(torch.equal(got[k], saved[k]) for k in saved)

    tok = transformers.AutoTokenizer.from_pretrained(d)
    rec = json.loads(open(os.path.join(d, EXPORT_FILE)).read())
    assert (rec["agent"], rec["step"], rec["tokenizer"]["files_written"]) == (agent, 1, True)
    assert rec["prompt"]["prepend_bos"] is (agent in ("gpt2", "char"))
    assert rec["model_class"] == type(model).__name__
    assert (rec["policy"]["kind"], "arch" in rec["policy"], "d_model" in rec["policy"]) == \
        (("decoder", False, True) if agent == "char" else ("hf", True, False))
    if agent == "gpt2":         # the base model it was fine-tuned from
        assert rec["policy"]["path"] == str(run / "gpt2-base")
    # the recorded prompt format, encoded by the exported tokenizer, and the exported chat
    # template (the tokenizer's own where hacpo used it: qwen3; else hacpo's format) give
    # hacpo's prompt ids (char: no 'é', '|' in its character set)
    for q in QUESTIONS[:2] if agent == "char" else QUESTIONS:
        text = rec["prompt"]["text"].replace(rec["prompt"]["placeholder"], q)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if rec["prompt"]["prepend_bos"]:
            ids = [tok.bos_token_id] + ids
        assert ids == pol.tokenizer.prompt_ids(q), q
        user = rec["prompt"]["chat_user_message"].replace(rec["prompt"]["placeholder"], q)
        chat = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
        assert list(chat) == pol.tokenizer.prompt_ids(q), q
    assert tok.decode(pol.tokenizer.response_ids("4+3=7 #### 7", add_eos=True),
                      skip_special_tokens=True) == "4+3=7 #### 7"
    assert tok.eos_token_id == pol.tokenizer.eos_id == model.generation_config.eos_token_id
    assert model.generation_config.pad_token_id == pol.tokenizer.pad_id
    if pol.tokenizer.bos_id is not None:    # the tokenizer's, not the base model's config's
        assert model.config.bos_token_id == model.generation_config.bos_token_id == \
            pol.tokenizer.bos_id

    prompts = [pol.tokenizer.prompt_ids(q) for q in QUESTIONS[:2]]
    # greedy answers: transformers' generate on the export = hacpo's sampler on the policy
    for p in prompts:
        ours = generate(pol, [p], num_samples=1, max_new_tokens=10, temperature=0.0)
        theirs = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                dtype=torch.long), do_sample=False, max_new_tokens=10)
        assert theirs[0, len(p):].tolist() == ours.response_ids[0]
    # teacher-forced log-probs of a response: the export's logits give hacpo's values
    resp = [pol.tokenizer.response_ids(" 5", add_eos=True)] * len(prompts)
    with torch.no_grad():
        want, mask = pol.response_logprobs(prompts, resp)
        for b, (p, r) in enumerate(zip(prompts, resp)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1,
                                                         :pol.tokenizer.vocab_size]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(lp, want[b, :len(r)], rtol=0, atol=1e-5)


def test_refused_agents_name_why_and_write_nothing(run):
    out = run / "refused"
    with pytest.raises(ValueError, match=r"cannot export from .*checkpoint.pt: agent small: its "
                                         r"vocabulary is reduced to the run's corpus \(policy."
                                         r"reduce_vocab=true\): .*--no-tokenizer") as e:
        export_checkpoint(str(run / "run"), str(out), agents=["small", "qwen3"],
                          echo=lambda *_: None)
    assert re.findall(r"[:;] agent (\w+): ", str(e.value)) == ["small"]
    with pytest.raises(ValueError, match=r"unknown agent\(s\) \['nope'\] .* holds \['char', "
                                         r"'qwen3', 'llama', 'gpt2', 'small'\]"):
        export_checkpoint(str(run / "run"), str(out), agents=["nope"], echo=lambda *_: None)
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'"):
        export_checkpoint(str(run / "run"), str(out), dtype="int8", echo=lambda *_: None)
    assert not out.exists()


def test_no_agent_named_exports_those_that_can_be(run):
    """Without --agents: every agent that can be exported is, the others are skipped with a
    line naming why; a run with none that can be is an error."""
    out, said = run / "all", []
    dirs = export_checkpoint(str(run / "run"), str(out), echo=said.append)
    assert list(dirs) == ["char", "qwen3", "llama", "gpt2"]
    assert sorted(os.listdir(out)) == ["char", "gpt2", "llama", "qwen3"]
    skipped = [s for s in said if s.startswith("[export] skipping")]
    assert len(skipped) == 1 and "agent small: its vocabulary is reduced" in skipped[0]
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    keep = [4]                      # small (reduced): nothing to export with a tokenizer
    state["agents"] = [state["agents"][i] for i in keep]
    state["config"]["agents"] = [state["config"]["agents"][i] for i in keep]
    state["tokenizers"] = [state["tokenizers"][i] for i in keep]
    (run / "none").mkdir()
    ckpt.save_atomic(state, str(run / "none" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"agent small: .*reduced"):
        export_checkpoint(str(run / "none"), str(run / "none-out"), echo=lambda *_: None)
    assert not (run / "none-out").exists()


def test_reduced_vocabulary_model_alone_in_bfloat16(run):
    """--no-tokenizer: the reduced-vocabulary agent's model alone, reading hacpo's ids; with
    --dtype bfloat16 its weights are the checkpoint's rounded to bf16."""
    out = run / "model-only"
    dirs = export_checkpoint(str(run / "run"), str(out), agents=["small"], tokenizer=False,
                             dtype="bfloat16", echo=lambda *_: None)
    d = dirs["small"]
    assert not os.path.exists(os.path.join(d, "tokenizer.json"))
    rec = json.loads(open(os.path.join(d, EXPORT_FILE)).read())
    pols, state, _ = _policies(run / "run")
    tok = pols["small"].tokenizer
    assert rec["tokenizer"] == {"name": "qwen3", "files_written": False,
                                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                                "pad_id": tok.pad_id, "bos_id": tok.bos_id, "reduced": True,
                                "kept_ids": tok.kept_ids()}
    # the tokenizer's id of each model id: generated ids mapped through it decode as hacpo's
    ids = tok.encode("What is 12 + 30? 42", errors="fallback")   # bytes where unseen
    assert tok.decode(ids) == tok.hf.decode([rec["tokenizer"]["kept_ids"][i] for i in ids]) \
        == "What is 12 + 30? 42"
    assert rec["dtype"] == "bfloat16" and rec["policy"]["reduce_vocab"] is True
    model = _hf(d, dtype=None)
    assert model.dtype == torch.bfloat16
    saved = next(a for a in state["agents"] if a["name"] == "small")["model"]
    got = model.state_dict()
    assert all(torch.equal(got[k.removeprefix("model.")], v.to(torch.bfloat16))
               for k, v in saved.items())
    assert model.config.vocab_size == tok.vocab_size


def test_vocabulary_of_other_data_is_refused(run):
    """A checkpoint that records no reduced vocabulary (written before it did) rebuilds it
    from the run's data: data that no longer gives the one its weights were trained with (here:
    its stored config edited to symbolic problems, "3+4-2=?") is refused, naming the agent:
    its ids would mean other tokens."""
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    state["config"]["data"]["wording"] = "symbolic"
    del state["vocabs"]
    (run / "edited").mkdir()
    ckpt.save_atomic(state, str(run / "edited" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"agent small's tokenizer \(\d+ tokens\) is not the "
                                         r"one its weights were trained with"):
        export_checkpoint(str(run / "edited"), str(run / "edited-out"), agents=["small"],
                          tokenizer=False, echo=lambda *_: None)
    assert not (run / "edited-out" / "small").exists()


def test_reduced_vocabulary_from_the_checkpoint_reads_no_data(run, monkeypatch):
    """The checkpoint records each reduced vocabulary's tokens: the export rebuilds it from
    them, reading none of the run's data (a large training file took minutes to tokenize
    again; here the data is made unreadable and changed: the same export as from the run)."""
    from hacpo.engine import checkpoint as ckpt
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    pols, _, _ = _policies(run / "run")
    assert state["vocabs"].keys() == {"small"}
    assert state["vocabs"]["small"].tolist() == pols["small"].tokenizer.kept_ids()
    state["config"]["data"]["wording"] = "symbolic"
    (run / "recorded").mkdir()
    ckpt.save_atomic(state, str(run / "recorded" / "checkpoint.pt"))

    def no_data(*a, **k):
        raise AssertionError("the run's data was read")
    monkeypatch.setattr(build, "load_data", no_data)
    dirs = export_checkpoint(str(run / "recorded"), str(run / "recorded-out"),
                             agents=["small"], tokenizer=False, echo=lambda *_: None)
    rec = json.loads(open(os.path.join(dirs["small"], EXPORT_FILE)).read())
    assert rec["tokenizer"]["kept_ids"] == pols["small"].tokenizer.kept_ids()
    got = _hf(dirs["small"], dtype=None).state_dict()
    saved = next(a for a in state["agents"] if a["name"] == "small")["model"]
    assert all(torch.equal(got[k.removeprefix("model.")], v) for k, v in saved.items())
    # a recorded vocabulary that is not the one the weights were trained with: refused
    v = state["vocabs"]["small"]
    i = next(k for k, x in enumerate(v.tolist()) if 255 < x < 151643)  # a word: not byte/special
    state["vocabs"]["small"] = torch.cat([v[:i], v[i + 1:]])
    ckpt.save_atomic(state, str(run / "recorded" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"agent small's tokenizer \(\d+ tokens\) is not the "
                                         r"one its weights were trained with \(its reduced "
                                         r"vocabulary is the checkpoint's record: did tokenizer "
                                         r"'qwen3''s files change since\?\)"):
        export_checkpoint(str(run / "recorded"), str(run / "recorded-out2"), agents=["small"],
                          tokenizer=False, echo=lambda *_: None)
    # one that is no vocabulary of this tokenizer (ids past its end): named as the record
    state["vocabs"]["small"] = torch.cat([v, torch.tensor([10 ** 7])])
    ckpt.save_atomic(state, str(run / "recorded" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"cannot export from .*recorded/checkpoint\.pt: agent "
                                         r"small's reduced vocabulary recorded there does not "
                                         r"fit .*ids outside this tokenizer's"):
        export_checkpoint(str(run / "recorded"), str(run / "recorded-out2"), agents=["small"],
                          tokenizer=False, echo=lambda *_: None)
    assert not (run / "recorded-out2").exists()


def test_a_run_with_another_data_template(run):
    """A run whose prompts wrapped the question in a data template ("boxed"): the recorded
    prompt text holds it, and the chat template given the recorded user message (the question
    in that template) gives the run's prompt ids, for a tokenizer's own chat template (qwen3)
    and hacpo's (llama)."""
    from hacpo.engine import checkpoint as ckpt
    from hacpo.engine.data import apply_prompt_template
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    state["config"]["data"]["template"] = "boxed"
    state["agents"], state["config"]["agents"], state["tokenizers"] = (
        [x[i] for i in (1, 2)] for x in (state["agents"], state["config"]["agents"],
                                         state["tokenizers"]))
    (run / "boxed").mkdir()
    ckpt.save_atomic(state, str(run / "boxed" / "checkpoint.pt"))
    dirs = export_checkpoint(str(run / "boxed"), str(run / "boxed-out"), echo=lambda *_: None)
    pols, _, _ = _policies(run / "run")
    q = "What is 2 + 3?"
    for agent, d in dirs.items():
        rec = json.loads(open(os.path.join(d, EXPORT_FILE)).read())["prompt"]
        assert rec["data_template"] == "boxed" and "\\boxed{}" in rec["text"]
        want = pols[agent].tokenizer.prompt_ids(apply_prompt_template("boxed", q))
        tok = transformers.AutoTokenizer.from_pretrained(d)
        user = rec["chat_user_message"].replace(rec["placeholder"], q)
        assert user == q + "\nPut the final answer in \\boxed{}."
        assert list(tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                            add_generation_prompt=True,
                                            return_dict=False)) == want, agent
        assert tok(rec["text"].replace(rec["placeholder"], q),
                   add_special_tokens=False)["input_ids"] == want, agent


def test_existing_folder_kept_unless_force_and_failed_write_leaves_nothing(run, monkeypatch):
    out = run / "again"
    export_checkpoint(str(run / "run"), str(out), agents=["qwen3"], echo=lambda *_: None)
    marker = out / "qwen3" / "mine.txt"
    marker.write_text("keep")
    with pytest.raises(FileExistsError, match=r"again/qwen3 already exist\(s\) \(--force"):
        export_checkpoint(str(run / "run"), str(out), agents=["qwen3"], echo=lambda *_: None)
    assert marker.read_text() == "keep"
    # a write that fails half-way: the old folder stays whole, no temp folder is left
    real = transformers.PreTrainedModel.save_pretrained

    def half(self, path, **kw):
        real(self, path, **kw)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", half)
    with pytest.raises(OSError, match=r"cannot write .*again/qwen3: .*No space left"):
        export_checkpoint(str(run / "run"), str(out), agents=["qwen3"], overwrite=True,
                          echo=lambda *_: None)
    assert sorted(os.listdir(out)) == ["qwen3"] and marker.read_text() == "keep"
    monkeypatch.undo()
    # the rename into place fails once the old folder is moved aside: it is moved back
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".qwen3.tmp-"):
            raise OSError(5, "Input/output error", src)
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match=r"cannot write .*again/qwen3: .*Input/output error"):
        export_checkpoint(str(run / "run"), str(out), agents=["qwen3"], overwrite=True,
                          echo=lambda *_: None)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == ["qwen3"] and marker.read_text() == "keep"
    export_checkpoint(str(run / "run"), str(out), agents=["qwen3"], overwrite=True,
                      echo=lambda *_: None)
    assert sorted(os.listdir(out)) == ["qwen3"] and not marker.exists()
    assert os.path.isfile(out / "qwen3" / "model.safetensors")


def assert_export_answers_as_run(run_dir, out_dir, own: dict, trainer: str, problems=4):
    """`hacpo export RUN --no-tokenizer` of every agent: transformers alone, on the model files,
    answers the first ``problems`` held-out problems greedily as the run's final evaluation
    did (``own``: agent -> responses, tests.engine.test_eval_harness.record_final_responses;
    hacpo's tokenizer gives the prompt ids and reads the answer)."""
    from hacpo.engine.data import apply_prompt_template
    assert cli.main(["export", str(run_dir), "--out", str(out_dir), "--no-tokenizer"]) == 0
    pols, state, cfg = _policies(run_dir)
    heldout = build.load_data(cfg).eval[:problems]
    max_new = cfg.eval_max_new_tokens or cfg.rollout.max_new_tokens
    answers = []
    for a in state["agents"]:
        d = os.path.join(out_dir, a["name"])
        rec = json.loads(open(os.path.join(d, EXPORT_FILE)).read())
        assert (rec["trainer"], rec["step"]) == (trainer, state["step"])
        model = _hf(d)
        got = model.state_dict()
        assert all(torch.equal(got[k.removeprefix("model.")], v) for k, v in a["model"].items())
        tok = pols[a["name"]].tokenizer
        for i, e in enumerate(heldout):
            p = tok.prompt_ids(apply_prompt_template(cfg.data.template, e.prompt))
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long), do_sample=False, max_new_tokens=max_new)
            answers.append(tok.decode(ids[0, len(p):].tolist()))
            assert [answers[-1]] == own[a["name"]][i], (a["name"], i)
    assert len(set(answers)) > 1, answers     # can fail: no answer, or the same for all


def test_cli(run, capsys):
    out = run / "cli"
    assert cli.main(["export", str(run / "run" / "checkpoint.pt"), "--out", str(out),
                     "--agents", "gpt2"]) == 0
    assert f"[export] written: {out / 'gpt2'}" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["gpt2"]
    assert cli.main(["export", str(run / "run"), "--out", str(out), "--agents", "small"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hacpo export: error: cannot export from ")
    assert "policy.reduce_vocab=true" in err[0] and "--no-tokenizer" in err[0]
    assert cli.main(["export", str(run / "nowhere"), "--out", str(out)]) == 2
    assert "hacpo export: error: " in capsys.readouterr().err
