"""An HF agent's model and tokenizer folders moved since its run (run and models copied to
another machine or mount): `hacpo eval` / `hacpo export` / `--resume` take their new place as
`--set agents.N.policy.path=NEW agents.N.policy.tokenizer=NEW`, checked to hold what the
checkpoint records (the model's config.json, the tokenizer's vocabulary); before, eval and
export failed ("unknown tokenizer '<old folder>': ... not an existing local path") and the
resume was refused ("the config differs from the checkpoint's in agents.0.policy.path")."""
import dataclasses
import json
import shutil

import pytest
import torch

from hacpo.engine import checkpoint as ckpt
from hacpo.engine.export import EXPORT_FILE
from hacpo.engine.trainer import train
from hacpo.launch import cli
from hacpo.models.hf import build_hf_model
from hacpo.models.tokenizer import CharTokenizer

from .test_export import one_step_tiny3

transformers = pytest.importorskip("transformers")


def _model_folder(where, layers=1):
    """A tiny HF Llama and its tokenizer (the char vocabulary's) in one folder, as
    save_pretrained writes them."""
    tok = CharTokenizer()
    tok.to_hf().save_pretrained(where)
    build_hf_model({"arch": "llama", "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": layers, "num_attention_heads": 2,
                    "num_key_value_heads": 1}, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                   pad_id=tok.pad_id, seed=3).save_pretrained(where)
    return str(where)


def _cfg(tmp, base, **over):
    cfg = one_step_tiny3(tmp, **{"agents.1.policy.kind": "hf", "agents.1.policy.path": base,
                                 "agents.1.policy.tokenizer": base,
                                 "agents.1.policy.reduce_vocab": False, **over})
    return dataclasses.replace(cfg, agents=[cfg.agents[1]])      # the HF agent alone


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 1-step run of one HF agent loaded from a model folder (its tokenizer in it), evaluated
    on a benchmark; then the folder is moved (renamed)."""
    tmp = tmp_path_factory.mktemp("moved")
    base = _model_folder(tmp / "base")
    train(_cfg(tmp, base), echo=lambda *_: None)
    (tmp / "b.jsonl").write_text("".join(json.dumps({"question": f"What is {a} + 2?",
                                                     "answer": f"#### {a + 2}"}) + "\n"
                                         for a in range(3)))
    assert cli.main(["eval", str(tmp / "run"), "--bench", f"b={tmp / 'b.jsonl'}",
                     "--out-dir", str(tmp / "before")]) == 0
    (tmp / "base").rename(tmp / "moved")
    return tmp


def _moved(run, folder="moved"):
    return ["--set", f"agents.0.policy.path={run / folder}",
            f"agents.0.policy.tokenizer={run / folder}"]


def test_eval_and_export_name_the_moved_folder(run, tmp_path, capsys):
    capsys.readouterr()
    bench = ["--bench", f"b={run / 'b.jsonl'}", "--out-dir", str(tmp_path / "eval")]
    assert cli.main(["eval", str(run / "run"), *bench]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"hacpo eval: error: cannot evaluate {run / 'run' / 'checkpoint.pt'}: agent qwen3's "
        f"policy.path {run / 'base'} does not exist (moved? --set agents.0.policy.path=NEW "
        f"names its new place)")
    assert cli.main(["export", str(run / "run"), "--out", str(tmp_path / "x"),
                     "--set", f"agents.0.policy.path={run / 'moved'}"]) == 2
    assert f"policy.tokenizer {run / 'base'} does not exist (moved? --set " \
           f"agents.0.policy.tokenizer=NEW" in capsys.readouterr().err
    # the same answers as before the move (the tokenizer folder's new name is no difference)
    assert cli.main(["eval", str(run / "run"), *bench, *_moved(run)]) == 0
    got = json.loads((tmp_path / "eval" / "qwen3__b.json").read_text())
    want = json.loads((run / "before" / "qwen3__b.json").read_text())
    assert got["problems"] == want["problems"]
    assert cli.main(["export", str(run / "run"), "--out", str(tmp_path / "x"), *_moved(run)]) == 0
    rec = json.loads((tmp_path / "x" / "qwen3" / EXPORT_FILE).read_text())
    assert rec["policy"]["path"] == str(run / "moved")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "x" / "qwen3")
    saved = ckpt.load(str(run / "run" / "checkpoint.pt"))["agents"][0]["model"]
    assert all(torch.equal(model.state_dict()[k.removeprefix("model.")], v)
               for k, v in saved.items())


def test_another_model_or_tokenizer_or_key_is_refused(run, tmp_path, capsys):
    other = _model_folder(tmp_path / "other", layers=2)
    shutil.copytree(run / "moved", tmp_path / "tok2")     # two tokens' ids swapped
    spec = json.loads((tmp_path / "tok2" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (tmp_path / "tok2" / "tokenizer.json").write_text(json.dumps(spec))
    ck = run / "run" / "checkpoint.pt"
    for sets, err in (
            ([f"agents.0.policy.path={other}", f"agents.0.policy.tokenizer={run / 'moved'}"],
             f"agents.0.policy.path={other}: another model than the run's ({run / 'base'}): "
             f"its config.json differs"),
            ([f"agents.0.policy.path={run / 'moved'}",
              f"agents.0.policy.tokenizer={tmp_path / 'tok2'}"],
             f"cannot export from {ck}: agent qwen3's tokenizer (91 tokens) is not the one "
             f"its weights were trained with"),
            ([f"agents.1.policy.path={other}"],
             f"--set agents.1.policy.path: {ck} has 1 agents (agents.0 to agents.0)"),
            (["agents.0.policy.name=x"],
             "--set agents.0.policy.name: only agents.N.policy.path / "
             "agents.N.policy.tokenizer (a model or tokenizer folder moved since the run) "
             "apply here"),
            ([f"agents.0.policy.path={tmp_path / 'nowhere'}"],
             f"agents.0.policy.path={tmp_path / 'nowhere'}: no such file or folder")):
        assert cli.main(["export", str(run / "run"), "--out", str(tmp_path / "x"),
                         "--set", *sets]) == 2
        said = capsys.readouterr().err.splitlines()[-1]     # (after transformers' bars)
        assert said.startswith(f"hacpo export: error: {err}"), sets
    assert not (tmp_path / "x").exists()


def test_a_run_resumes_over_its_model_folder_moved(run, tmp_path):
    shutil.copytree(run / "run", tmp_path / "run")
    other = _model_folder(tmp_path / "other", layers=2)
    moved = str(run / "moved")

    def cfg(path, steps=2):
        return dataclasses.replace(_cfg(tmp_path, path, **{"agents.1.policy.tokenizer": moved}),
                                   steps=steps)
    with pytest.raises(ValueError, match=r"cannot resume .*: agents\.0\.policy\.path=.*/other: "
                                         r"another model than the run's \(.*/base\)"):
        train(cfg(other), resume=True, echo=lambda *_: None)
    train(cfg(moved), resume=True, echo=lambda *_: None)
    state = ckpt.load(str(tmp_path / "run" / "checkpoint.pt"))
    assert state["step"] == 2 and state["config"]["agents"][0]["policy"]["path"] == moved
    train(cfg(moved, 3), resume=True, echo=lambda *_: None)     # its place is the run's now
    state = ckpt.load(str(tmp_path / "run" / "checkpoint.pt"))
    del state["model_configs"]          # a checkpoint written before the record
    ckpt.save_atomic(state, str(tmp_path / "run" / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"agents\.0\.policy\.path=.*/other: the checkpoint "
                                         r"does not record what the run's folder .*/moved held"):
        train(cfg(other, 4), resume=True, echo=lambda *_: None)
