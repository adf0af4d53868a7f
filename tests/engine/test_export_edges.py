"""`hacpo export` edge cases not pinned by test_export.py: an HF agent with an untied output
layer and a GPT-2 (Conv1D) agent export bit for bit and answer as the policy does; exporting
changes nothing in the run dir nor in hacpo's cached tokenizers; --force replaces a file or a
symbolic link at an agent's path (not the link's target); a Ctrl-C mid-write leaves no temporary
folder and the old folder whole; an agent whose name is no plain file name gets agent<index>
(and no agent another's name); a full disk is the one-line storage error; hacpo's own prompt
format as a chat template takes exactly one user message; padded embedding rows are never
generated."""
import dataclasses
import hashlib
import json
import os

import pytest
import torch

from hacpo.engine import checkpoint as ckpt
from hacpo.engine.export import EXPORT_FILE, export_checkpoint
from hacpo.engine.trainer import train
from hacpo.launch import cli
from hacpo.models.generation import generate
from hacpo.models.tokenizer import _load_hf, tokenizer_path

from .test_export import _policies, one_step_tiny3

transformers = pytest.importorskip("transformers")

QUESTIONS = ["What is 2 + 3?", "Ann has 4 eggs. She gets 3 more. How many eggs does Ann have?"]


def _quiet(*_):
    pass


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 1-step run of two HF agents: untied (Qwen2 with tie_word_embeddings=false on the whole
    Qwen3 tokenizer) and g2 (transformers' GPT-2, Conv1D layers, on the whole GPT-2 tokenizer)."""
    tmp = tmp_path_factory.mktemp("exportedges")
    cfg = one_step_tiny3(tmp, **{
        "agents.1.policy.kind": "hf", "agents.1.policy.arch": "qwen2",
        "agents.1.policy.reduce_vocab": False,
        "agents.1.policy.hf_config": {"tie_word_embeddings": False}})
    a = cfg.agents[1]
    g2 = dataclasses.replace(a, policy=dataclasses.replace(
        a.policy, name="g2", tokenizer="gpt2", arch="gpt2", hf_config={}, seed=4))
    untied = dataclasses.replace(a, policy=dataclasses.replace(a.policy, name="untied"))
    train(dataclasses.replace(cfg, agents=[untied, g2]), echo=_quiet)
    return tmp


def _tree(path):
    """Every file under ``path``: its bytes' sha256 and mtime."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = (hashlib.sha256(fh.read()).hexdigest(),
                                                 os.stat(p).st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def exported(run):
    """Both agents exported; the run dir's files and the cached GPT-2 / Qwen3 tokenizer
    objects as they were before."""
    cached = {n: _load_hf(os.path.abspath(tokenizer_path(n))) for n in ("gpt2", "qwen3")}
    before = {n: (h.eos_token, h.pad_token, h.chat_template, h.backend_tokenizer.to_str())
              for n, h in cached.items()}
    tree = _tree(run / "run")
    dirs = export_checkpoint(str(run / "run"), str(run / "out"), echo=_quiet)
    return dirs, cached, before, tree


@pytest.mark.parametrize("agent", ["untied", "g2"])
def test_untied_and_conv1d_agents_export_as_trained(run, exported, agent):
    dirs, *_ = exported
    pols, state, _ = _policies(run / "run")
    pol = pols[agent]
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[agent],
                                                              dtype=torch.float32).eval()
    assert type(model).__name__ == {"untied": "Qwen2ForCausalLM",
                                    "g2": "GPT2LMHeadModel"}[agent]
    saved = {k.removeprefix("model."): v for k, v in
             next(a for a in state["agents"] if a["name"] == agent)["model"].items()}
    got = model.state_dict()
    assert set(got) == set(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    if agent == "untied":       # its own output layer, not the embedding (can fail: tied)
        assert model.config.tie_word_embeddings is False
        assert not torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    tok = pol.tokenizer
    for q in QUESTIONS:
        p = tok.prompt_ids(q)
        ours = generate(pol, [p], num_samples=1, max_new_tokens=8, temperature=0.0)
        theirs = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                dtype=torch.long), do_sample=False, max_new_tokens=8)
        assert theirs[0, len(p):].tolist() == ours.response_ids[0]
        r = tok.response_ids(" 5", add_eos=True)
        with torch.no_grad():
            want, _ = pol.response_logprobs([p], [r])
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        torch.testing.assert_close(lp, want[0, :len(r)], rtol=0, atol=1e-5)


def test_export_changes_neither_the_run_nor_hacpos_cached_tokenizers(run, exported):
    dirs, cached, before, tree = exported
    assert _tree(run / "run") == tree
    # the exported GPT-2 tokenizer got a pad token and hacpo's prompt format as its chat
    # template; hacpo's cached one (shared by every policy of the process) did not
    hf = transformers.AutoTokenizer.from_pretrained(dirs["g2"])
    assert hf.pad_token == "<|endoftext|>" and hf.chat_template
    for n, h in cached.items():
        assert _load_hf(os.path.abspath(tokenizer_path(n))) is h
        assert (h.eos_token, h.pad_token, h.chat_template, h.backend_tokenizer.to_str()) == \
            before[n], n
    assert before["gpt2"][1] is None and before["gpt2"][2] is None   # can fail: were edited


def test_force_replaces_a_file_or_link_at_the_agent_path_not_its_target(run, exported):
    out, target = run / "force", run / "target"
    out.mkdir()
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    (out / "untied").write_text("a file")
    os.symlink(target, out / "g2")
    with pytest.raises(FileExistsError, match=r"untied, .*g2 already exist\(s\)"):
        export_checkpoint(str(run / "run"), str(out), echo=_quiet)
    assert (out / "untied").is_file() and (out / "g2").is_symlink()
    export_checkpoint(str(run / "run"), str(out), overwrite=True, echo=_quiet)
    assert sorted(os.listdir(out)) == ["g2", "untied"]
    for a in ("g2", "untied"):
        assert not (out / a).is_symlink() and (out / a / "model.safetensors").is_file()
    assert sorted(os.listdir(target)) == ["keep.txt"]


def test_ctrl_c_mid_write_leaves_no_temp_folder(run, exported, monkeypatch):
    out = run / "interrupted"
    real = transformers.PreTrainedTokenizerBase.save_pretrained

    def interrupted(self, *a, **kw):
        real(self, *a, **kw)
        raise KeyboardInterrupt
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(str(run / "run"), str(out), agents=["g2"], echo=_quiet)
    assert not out.exists()      # no temp folder; the output folder it made is gone too
    monkeypatch.undo()
    export_checkpoint(str(run / "run"), str(out), agents=["g2"], echo=_quiet)
    (out / "g2" / "mine.txt").write_text("old")
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(str(run / "run"), str(out), agents=["g2"], overwrite=True,
                          echo=_quiet)
    assert os.listdir(out) == ["g2"] and (out / "g2" / "mine.txt").read_text() == "old"


def test_an_agent_name_that_is_no_plain_file_name_gets_agent_index(run, exported):
    """A stored run may hold an agent named "g 2" (a space: refused for new runs only); its
    folder is agent<index>, and hacpo_export.json names it."""
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    state["agents"][1]["name"] = state["config"]["agents"][1]["policy"]["name"] = "g 2"
    (run / "renamed").mkdir()
    ckpt.save_atomic(state, str(run / "renamed" / "checkpoint.pt"))
    out = run / "renamed-out"
    dirs = export_checkpoint(str(run / "renamed"), str(out), agents=["g 2"], echo=_quiet)
    assert dirs == {"g 2": str(out / "agent1")} and os.listdir(out) == ["agent1"]
    rec = json.loads((out / "agent1" / EXPORT_FILE).read_text())
    assert (rec["agent"], rec["agent_index"]) == ("g 2", 1)


def test_disk_full_is_one_line_and_exit_2_and_leaves_no_folder(run, exported, monkeypatch,
                                                               capsys):
    """safetensors reports ENOSPC as a SafetensorError ("... (os error 28)"), tokenizers as a
    bare Exception: both are the one-line storage error (exit status 2), and the output folder
    the export made is gone again (before: a traceback, exit status 1)."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    def full(*a, **kw):     # what safetensors raises on ENOSPC (seen on a full tmpfs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(mu, "safe_save_file", full)
    assert cli.main(["export", str(run / "run"), "--out", str(run / "full")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hacpo")]
    assert len(err) == 1 and err[0].startswith("hacpo export: error: cannot write ")
    assert "No space left on device" in err[0]
    assert not (run / "full").exists()
    monkeypatch.undo()
    # an error that is no I/O error keeps its type (a bug keeps its traceback)
    monkeypatch.setattr(mu, "safe_save_file", lambda *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        export_checkpoint(str(run / "run"), str(run / "full"), echo=_quiet)
    (run / "kept").mkdir()                  # a folder that was there stays, even if empty
    with pytest.raises(ZeroDivisionError):
        export_checkpoint(str(run / "run"), str(run / "kept"), echo=_quiet)
    assert os.listdir(run / "kept") == [] and not (run / "full").exists()
    with pytest.raises(ZeroDivisionError):      # the parents it made go too
        export_checkpoint(str(run / "run"), str(run / "made" / "a" / "b"), echo=_quiet)
    assert not (run / "made").exists()


def test_agent_folder_is_its_own_and_never_another_agents_name(run, exported):
    """Folders are decided over all the run's agents: an agent named "agent1" keeps its name,
    and "g 2" (no plain file name) gets another, whichever agents an export names (before:
    "g 2" alone went to agent1, another agent's name, and a clash renamed every folder)."""
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    for i, n in ((0, "agent1"), (1, "g 2")):
        state["agents"][i]["name"] = state["config"]["agents"][i]["policy"]["name"] = n
    (run / "clash").mkdir()
    ckpt.save_atomic(state, str(run / "clash" / "checkpoint.pt"))
    one = export_checkpoint(str(run / "clash"), str(run / "clash-a"), agents=["g 2"],
                            echo=_quiet)
    both = export_checkpoint(str(run / "clash"), str(run / "clash-b"), echo=_quiet)
    assert os.path.basename(both["agent1"]) == "agent1"        # its own name, always
    assert os.path.basename(one["g 2"]) == os.path.basename(both["g 2"]) == "agent1_"


def test_hacpos_own_prompt_format_as_chat_template_takes_one_user_message(run, exported):
    """g2 (GPT-2: hacpo's plain template with BOS): one user message renders the trained
    prompt; a system message or a conversation, which that format cannot hold, is an error
    naming the roles (not a prompt with messages silently left out)."""
    dirs = exported[0]
    tok = transformers.AutoTokenizer.from_pretrained(dirs["g2"])
    pols, _, _ = _policies(run / "run")
    q = QUESTIONS[0]
    assert list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False)) == \
        pols["g2"].tokenizer.prompt_ids(q)
    for msgs, roles in (([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": q}], "system, user"),
                        ([{"role": "user", "content": q}, {"role": "assistant", "content": "5"},
                          {"role": "user", "content": q}], "user, assistant, user"),
                        ([{"role": "assistant", "content": "5"}], "assistant")):
        with pytest.raises(Exception, match=f"one user message .*got {roles}"):
            tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_padded_embedding_rows_are_never_generated(tmp_path):
    """A policy.path model with more embedding rows than its tokenizer has ids (as Qwen ships
    them): hacpo samples from the tokenizer's ids only, and so does transformers' generate on
    the export (generation_config.suppress_tokens), even where a padded row has the largest
    logit (before: transformers generated ids hacpo never samples)."""
    from hacpo.engine.export import _write_agent
    from hacpo.models.hf import build_hf_model
    from hacpo.models.policy import PolicyConfig, build_policy
    from hacpo.models.tokenizer import load_tokenizer
    V = load_tokenizer("qwen3").vocab_size
    base = build_hf_model({"arch": "qwen2"}, vocab_size=V + 37, eos_id=0, pad_id=0, seed=2)
    with torch.no_grad():       # the padded rows dominate every logit
        base.model.embed_tokens.weight[V:] = base.model.embed_tokens.weight[:V].sum(0) * 5
    base.save_pretrained(tmp_path / "base")
    pol = build_policy(PolicyConfig(name="padded", kind="hf", arch="qwen2", tokenizer="qwen3",
                                    path=str(tmp_path / "base")))
    _write_agent(pol, str(tmp_path / "padded"), record={}, tokenizer=True, dtype=None,
                 overwrite=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "padded").eval()
    assert model.generation_config.suppress_tokens == list(range(V, V + 37))
    # config.json names hacpo's EOS / pad too, not the base model's (id 0; vLLM reads it)
    for c in (model.config, model.generation_config):
        assert (c.eos_token_id, c.pad_token_id) == (pol.tokenizer.eos_id, pol.tokenizer.pad_id)
    p = pol.tokenizer.prompt_ids(QUESTIONS[0])
    with torch.no_grad():
        assert int(model(torch.tensor([p])).logits[0, -1].argmax()) >= V   # can fail
    ours = generate(pol, [p], num_samples=1, max_new_tokens=6, temperature=0.0)
    out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                         dtype=torch.long), do_sample=False, max_new_tokens=6)
    assert out[0, len(p):].tolist() == ours.response_ids[0]


def test_cli_flags_reach_the_export(run, exported, capsys):
    """`hacpo export --agents g2 --no-tokenizer --dtype bfloat16 --force` over an existing
    folder: the model alone, in bf16, replacing the folder (each flag reaches the export)."""
    out = run / "cli-flags"
    (out / "g2").mkdir(parents=True)
    (out / "g2" / "old.txt").write_text("old")
    assert cli.main(["export", str(run / "run"), "--out", str(out), "--agents", "g2",
                     "--no-tokenizer", "--dtype", "bfloat16", "--force"]) == 0
    assert f"[export] written: {out / 'g2'}" in capsys.readouterr().out
    d = out / "g2"
    assert os.listdir(out) == ["g2"] and not (d / "old.txt").exists()
    assert not [f for f in os.listdir(d) if f.startswith("tokenizer")]
    rec = json.loads((d / EXPORT_FILE).read_text())
    assert (rec["dtype"], rec["tokenizer"]["files_written"]) == ("bfloat16", False)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=None)
    assert model.dtype == torch.bfloat16


def test_cli_key_error_is_its_message(monkeypatch, capsys):
    """A KeyError (a checkpoint missing a field) is its message on one line, not its repr."""
    import hacpo.engine.export as export

    def missing(*a, **kw):
        raise KeyError("checkpoint.pt has no 'agents'")
    monkeypatch.setattr(export, "export_checkpoint", missing)
    assert cli.main(["export", "somewhere", "--out", "elsewhere"]) == 2
    assert capsys.readouterr().err.strip() == "hacpo export: error: checkpoint.pt has no 'agents'"


def test_file_modes_follow_the_umask(run, exported):
    """The folder and its files get the modes the umask gives new ones (here 027: 0750 and
    0640, not mkdtemp's 0700 / safetensors' 0600, nor a fixed 0644)."""
    old = os.umask(0o027)
    try:
        d = export_checkpoint(str(run / "run"), str(run / "umask"), agents=["g2"],
                              echo=_quiet)["g2"]
    finally:
        os.umask(old)
    assert os.stat(d).st_mode & 0o777 == 0o750
    assert {f: os.stat(os.path.join(d, f)).st_mode & 0o777 for f in os.listdir(d)} == \
        {f: 0o640 for f in os.listdir(d)}


def test_a_folder_made_while_writing_is_kept_unless_force(run, exported, monkeypatch):
    """A folder that appears at the agent's path during the write (another export, a user) is
    an error, kept whole, and no temporary folder is left; with --force it is replaced."""
    out = run / "race"
    real = transformers.PreTrainedModel.save_pretrained

    def and_theirs(self, path, **kw):
        real(self, path, **kw)
        (out / "g2").mkdir(exist_ok=True)
        (out / "g2" / "theirs.txt").write_text("theirs")
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", and_theirs)
    with pytest.raises(FileExistsError) as e:
        export_checkpoint(str(run / "run"), str(out), agents=["g2"], tokenizer=False,
                          echo=_quiet)
    assert str(e.value) == f"{out / 'g2'} exists (--force replaces it)"
    assert os.listdir(out) == ["g2"] and os.listdir(out / "g2") == ["theirs.txt"]
    export_checkpoint(str(run / "run"), str(out), agents=["g2"], tokenizer=False,
                      overwrite=True, echo=_quiet)
    assert os.listdir(out) == ["g2"] and (out / "g2" / "model.safetensors").is_file()
    assert not (out / "g2" / "theirs.txt").exists()


def test_the_record_names_the_trainer_the_run_gave_each_agent():
    from hacpo.engine.export import _stored_trainer
    state = {"config": {"agents": [{"trainer": "megatron"}, {"policy": {}}]}}
    assert [_stored_trainer(state, i) for i in (0, 1)] == ["megatron", "torch"]


class _Format:
    """A hacpo tokenizer stand-in whose plain prompt format is ``fmt``."""
    name, _use_chat, _add_bos = "fmt", False, False

    def __init__(self, fmt):
        self.fmt = fmt

    def prompt_text(self, question):
        return self.fmt.replace("{question}", question)


def test_a_prompt_format_with_jinja_syntax_is_rendered_as_text():
    """Text around the question that reads as Jinja ("{{", "{% if") is rendered as is (raw);
    one holding "{% endraw %}", which raw cannot hold, is refused."""
    from hacpo.engine.export import _chat_template
    from hacpo.models.tokenizer import load_tokenizer
    hf = load_tokenizer("char").to_hf()
    fmt = "{% if x %}{{ q }} Q: {question}\nA: {#"
    hf.chat_template = _chat_template(_Format(fmt))
    assert hf.apply_chat_template([{"role": "user", "content": "2+3?"}], tokenize=False,
                                  add_generation_prompt=True) == fmt.replace("{question}", "2+3?")
    with pytest.raises(ValueError, match="endraw"):
        _chat_template(_Format("{% endraw %}Q: {question}"))


def test_a_tokenizers_own_chat_template_is_kept(run, exported):
    """untied trained on Qwen3's own chat template: the export keeps it (a system message
    renders as Qwen3 renders it), not hacpo's one-user-message rendering of it."""
    dirs, _, before, _ = exported
    tok = transformers.AutoTokenizer.from_pretrained(dirs["untied"])
    assert before["qwen3"][2] and tok.chat_template == before["qwen3"][2]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    assert "Be brief." in tok.apply_chat_template(msgs, tokenize=False,
                                                  add_generation_prompt=True)


def test_weights_of_agents_the_config_does_not_name_are_refused(run, exported):
    """A checkpoint whose weights name another agent than its config: the error says so
    (not a KeyError on the name), and nothing is written."""
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    state["agents"][0]["name"] = "other"
    (run / "misnamed").mkdir()
    ckpt.save_atomic(state, str(run / "misnamed" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"its config names agents \['g2', 'untied'\] but its "
                                         r"weights are of \['other', 'g2'\]"):
        export_checkpoint(str(run / "misnamed"), str(run / "misnamed-out"), echo=_quiet)
    assert not (run / "misnamed-out").exists()


def test_an_agent_whose_prompt_encoding_changed_since_the_checkpoint_is_said(run, exported):
    """An agent whose tokenizer encodes text otherwise than when the checkpoint was written
    (its recorded encoding digest edited here: a chat template changed since) is exported
    with the tokenizer files of now, as asked, with a one-line note naming it (a resume is
    refused instead); an unchanged agent gets none."""
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    assert [a["name"] for a in state["agents"]] == ["untied", "g2"]
    state["encodings"][1] = "0" * 64
    (run / "reencoded").mkdir()
    ckpt.save_atomic(state, str(run / "reencoded" / "checkpoint.pt"))
    said = []
    dirs = export_checkpoint(str(run / "reencoded"), str(run / "reencoded-out"),
                             tokenizer=False, echo=said.append)
    assert sorted(dirs) == ["g2", "untied"]
    notes = [s for s in said if "note" in s]
    assert len(notes) == 1 and notes[0].startswith(
        "[export] note: agent g2's prompts are not encoded as when its weights were trained: ")
    assert notes[0].endswith("; the folder holds the tokenizer files of now")


def test_folder_names_never_clash_even_case_insensitively():
    """agent<index> takes as many "_" as it needs to be no other agent's folder, compared
    case-insensitively (macOS / Windows file systems): never two agents in one folder."""
    from hacpo.engine.export import _dir_names
    assert _dir_names(["agent1_", "g 2", "agent1"]) == \
        {"agent1_": "agent1_", "g 2": "agent1__", "agent1": "agent1"}
    assert _dir_names(["Agent1", "g 2"]) == {"Agent1": "Agent1", "g 2": "agent1_"}
    assert _dir_names(["..", "a/b", "ok"]) == {"..": "agent0", "a/b": "agent1", "ok": "ok"}


def test_weights_that_do_not_fit_the_rebuilt_policy_are_a_value_error(run, exported):
    """A checkpoint whose weights lack a tensor of the policy its config builds: ValueError
    naming the agent (export's contract), and nothing is written."""
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    model = state["agents"][1]["model"]
    del model[next(iter(model))]
    (run / "unfit").mkdir()
    ckpt.save_atomic(state, str(run / "unfit" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"agent g2's weights do not fit its policy rebuilt"):
        export_checkpoint(str(run / "unfit"), str(run / "unfit-out"), agents=["g2"],
                          echo=_quiet)
    assert not (run / "unfit-out").exists()


def test_an_error_after_an_agent_was_written_keeps_it_and_its_output_folder(run, exported,
                                                                           monkeypatch):
    """Ctrl-C while writing the second agent into an output folder the export made: the
    interrupt propagates (not an OSError from removing the non-empty folder), and the first
    agent's folder stays, complete."""
    out = run / "second-fails"
    real, calls = transformers.PreTrainedTokenizerBase.save_pretrained, []

    def second_interrupted(self, *a, **kw):
        calls.append(1)
        real(self, *a, **kw)
        if len(calls) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained",
                        second_interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(str(run / "run"), str(out), echo=_quiet)
    assert os.listdir(out) == ["untied"] and (out / "untied" / "model.safetensors").is_file()


def test_the_record_and_the_echo_name_the_checkpoints_step(run, exported):
    """hacpo_export.json and the echoed line name the step the checkpoint was saved at (this
    one edited to step 7: the run itself has one step only), and where it came from: the
    checkpoint file, its run dir and the run's trainer backend (edited to ray here)."""
    state = ckpt.load(str(run / "run" / "checkpoint.pt"))
    state["step"] = 7
    state["config"]["trainer_backend"] = "ray"
    (run / "step7").mkdir()
    ckpt.save_atomic(state, str(run / "step7" / "checkpoint.pt"))
    said = []
    d = export_checkpoint(str(run / "step7"), str(run / "step7-out"), agents=["g2"],
                          tokenizer=False, echo=said.append)["g2"]
    record = json.loads(open(os.path.join(d, EXPORT_FILE)).read())
    assert record["step"] == 7
    assert (record["checkpoint"], record["run_dir"], record["trainer_backend"]) == \
        (str(run / "step7" / "checkpoint.pt"), str(run / "step7"), "ray")
    import hacpo
    assert record["hacpo_version"] == hacpo.__version__ and hacpo.__version__.count(".") == 2
    assert f"[export] g2 (step 7) -> {d} (model only: no tokenizer files)" in said


def test_a_single_padded_embedding_row_is_suppressed(tmp_path):
    """The boundary of the padded rows: one row past the tokenizer's ids is suppressed too."""
    from hacpo.engine.export import _write_agent
    from hacpo.models.hf import build_hf_model
    from hacpo.models.policy import PolicyConfig, build_policy
    from hacpo.models.tokenizer import load_tokenizer
    V = load_tokenizer("qwen3").vocab_size
    build_hf_model({"arch": "qwen2"}, vocab_size=V + 1, eos_id=0, pad_id=0,
                   seed=2).save_pretrained(tmp_path / "base")
    pol = build_policy(PolicyConfig(name="one", kind="hf", arch="qwen2", tokenizer="qwen3",
                                    path=str(tmp_path / "base")))
    _write_agent(pol, str(tmp_path / "one"), record={}, tokenizer=False, dtype=None,
                 overwrite=False)
    cfg = json.loads((tmp_path / "one" / "generation_config.json").read_text())
    assert cfg["suppress_tokens"] == [V]


def test_force_when_the_old_folder_cannot_move_aside_leaves_it_and_nothing_else(tmp_path,
                                                                                 monkeypatch):
    """--force, and the old folder cannot be moved aside (EBUSY: a mount point): the error
    names the folder, which stays as it was, with no temporary or `.old-` folder beside it
    (before: an empty `.old-` folder was left)."""
    from hacpo.engine.export import _write_agent
    from hacpo.models.policy import PolicyConfig, build_policy
    pol = build_policy(PolicyConfig(name="c", kind="decoder", tokenizer="char", d_model=32,
                                    n_layers=1, n_heads=2))
    final = tmp_path / "c"
    final.mkdir()
    (final / "mine.txt").write_text("old")
    real = os.rename

    def rename(src, dst):
        if str(src) == str(final):
            raise OSError(16, "Device or resource busy", src)
        real(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match=r"cannot write .*/c: .*Device or resource busy"):
        _write_agent(pol, str(final), record={}, tokenizer=False, dtype=None, overwrite=True)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["c"] and os.listdir(final) == ["mine.txt"]


def test_hacpo_traceback_raises_the_input_error(tmp_path, monkeypatch, capsys):
    """HACPO_TRACEBACK=1: the error itself (its traceback), not the one line and exit 2."""
    monkeypatch.setenv("HACPO_TRACEBACK", "1")
    with pytest.raises((OSError, ValueError), match="nowhere"):
        cli.main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert "hacpo export: error" not in capsys.readouterr().err
    monkeypatch.delenv("HACPO_TRACEBACK")
    assert cli.main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2


def test_what_an_export_killed_while_writing_left_is_removed_by_the_next(run, exported, capsys):
    """kill -9 (the OOM killer) mid-write left a hidden .<agent>.tmp-XXXX/ folder, a model's
    size, that nothing removed (a successful rerun kept it, each kill added one); killed
    between its two renames, the previous export sat in .<agent>.old-XXXX/x with no <agent>/.
    The writer's host and pid are in the names now: the next export removes a dead one's
    leftovers and puts the previous export back; a live writer's, or another host's, stay."""
    import socket
    import subprocess
    import sys
    out = run / "killed"
    export_checkpoint(str(run / "run"), str(out), agents=["g2"], echo=_quiet)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    tmp = out / f".g2.tmp-{host}.{dead.pid}.abc123"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    old = out / f".g2.old-{host}.{dead.pid}.def456"
    old.mkdir()
    os.rename(out / "g2", old / "x")              # killed between the renames
    live = out / f".g2.tmp-{host}.{os.getppid()}.ghi789"      # a live writer's
    other = out / f".g2.tmp-otherhost.{dead.pid}.jkl012"       # another host's
    live.mkdir()
    other.mkdir()
    with pytest.raises(FileExistsError, match="already exist"):   # the previous one, back
        export_checkpoint(str(run / "run"), str(out), agents=["g2"], echo=print)
    said = capsys.readouterr().out
    assert f"[export] removed what an export of {out / 'g2'} killed while writing left: " \
           f"{old.name}, {tmp.name}" in said
    assert sorted(os.listdir(out)) == sorted(["g2", live.name, other.name])
    assert (out / "g2" / "hacpo_export.json").exists()
