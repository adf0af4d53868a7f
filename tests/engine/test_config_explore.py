"""What a user writes in a config, found wrong by an exploratory audit: the data settings that
name one of a fixed set (or registered) thing are checked when the config loads, naming the
key, so `hacpo launch slurm` refuses them before it submits (they were errors only once a run
built its data, without the key: "unknown difficulty 'hrad'")."""
import pytest

from hacpo.engine import data as data_mod
from hacpo.engine.run_config import load_config

from .test_config_validation import _yaml


@pytest.mark.parametrize("key,bad,msg", [
    ("data.difficulty", "hrad", r"^data\.difficulty must be one of easy, medium, hard, got "
                                r"'hrad'$"),
    ("data.wording", "words", r"^data\.wording must be one of word, symbolic, got 'words'$"),
    ("data.field_map", "gsm8", r"^unknown data\.field_map 'gsm8'; one of auto, gsm8k, math, "
                               r"math_answer, question_answer$"),
])
def test_a_data_name_is_checked_when_the_config_loads(tmp_path, key, bad, msg):
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", overrides={key: bad})
    section, name = key.split(".")
    with pytest.raises(ValueError, match=msg):          # the same from a YAML file
        load_config("tiny3", _yaml(tmp_path, f"{section}:\n  {name}: {bad}\n"))


def test_every_known_data_name_still_loads():
    for level in ("easy", "medium", "hard"):
        assert load_config("tiny3", overrides={"data.difficulty": level}).data.difficulty == level
    assert load_config("tiny3", overrides={"data.wording": "symbolic"}).data.wording == "symbolic"
    for fm in ("auto", "gsm8k", "math", "math_answer", "question_answer"):
        assert load_config("tiny3", overrides={"data.field_map": fm}).data.field_map == fm


def test_an_unknown_prompt_template_is_refused_before_any_work(monkeypatch):
    """data.template is refused by check_runnable (what `hacpo train` and the launchers' dry
    runs call first), as reward.name is; one the caller's code registered is accepted."""
    cfg = load_config("tiny3", overrides={"data.template": "chatml"})
    with pytest.raises(ValueError, match=r"^unknown data\.template 'chatml'; registered "
                                         r"templates: plain, boxed, short "):
        cfg.check_runnable()
    # a quoted --set value keeps its quotes (a str field takes the text as it is): named too
    quoted = load_config("tiny3", overrides={"data.template": "'boxed'"})
    with pytest.raises(ValueError, match=r"unknown data\.template \"'boxed'\""):
        quoted.check_runnable()
    monkeypatch.setattr(data_mod, "PROMPT_TEMPLATES", dict(data_mod.PROMPT_TEMPLATES))
    data_mod.register_prompt_template("chatml", "<q>{question}</q>")
    cfg.check_runnable()
    load_config("tiny3", overrides={"data.template": "boxed"}).check_runnable()


def test_an_hf_config_number_in_exponent_form_is_a_number(tmp_path):
    """YAML 1.1 reads `rope_theta: 1e4` (no dot) and `1.0e5` (no exponent sign) as strings;
    hf_config has no field types to parse them by, so '1e4' passed the config's checks and the
    model's build failed (TypeError: unsupported operand type(s) for ** or pow(): 'str' and
    'Tensor', a traceback after the warm-up). Other strings stay strings."""
    from hacpo.models.hf import build_hf_model
    cfg = load_config("tiny3", _yaml(tmp_path, (
        "agents:\n  0:\n    policy:\n      kind: hf\n      hf_config:\n"
        "        rope_theta: 1.0e5\n        rms_norm_eps: 1e-6\n"
        "        rope_scaling: {factor: 8E-1, rope_type: linear}\n")))
    hf = cfg.agents[0].policy.hf_config
    assert hf == {"rope_theta": 1e5, "rms_norm_eps": 1e-6,
                  "rope_scaling": {"factor": 0.8, "rope_type": "linear"}}
    assert type(hf["rope_theta"]) is float and type(hf["rope_scaling"]["factor"]) is float
    # the same through --set, and the model builds with it
    cfg = load_config("tiny3", overrides={"agents.0.policy.kind": "hf",
                                          "agents.0.policy.hf_config": "{rope_theta: 5e5}"})
    assert cfg.agents[0].policy.hf_config == {"rope_theta": 5e5}
    build_hf_model({"arch": "llama", **cfg.agents[0].policy.hf_config}, vocab_size=16)


def test_an_agent_edit_before_the_agents_list_that_replaces_it_is_an_error(tmp_path):
    """A dotted agents.N key before an agents: list in one file edited the preset's agent the
    list then replaced: the value was silently lost (lr the default). After the list it edits
    the list's agent, as --set does (README)."""
    lst = "agents:\n  - policy: {name: a}\n  - policy: {name: b}\n"
    with pytest.raises(ValueError, match=r"run\.yaml: agents\.0\.optim\.lr edits an agent that "
                                         r"the agents list after it replaces \(it would be lost\)"):
        load_config("tiny3", _yaml(tmp_path, "agents.0.optim.lr: 2.0e-4\n" + lst))
    cfg = load_config("tiny3", _yaml(tmp_path, lst + "agents.0.optim.lr: 2.0e-4\n"))
    assert [(a.policy.name, a.optim.lr) for a in cfg.agents] == [("a", 2e-4), ("b", 1e-4)]
    # a key of another section before the list is no such edit
    cfg = load_config("tiny3", _yaml(tmp_path, "steps: 3\n" + lst))
    assert (cfg.steps, len(cfg.agents)) == (3, 2)


def test_a_model_folder_with_its_own_tokenizer_and_the_default_char_is_refused(tmp_path):
    """policy.path of a pretrained model (its tokenizer files beside it) with no
    policy.tokenizer: the default, char, was used, and the model trained on character ids
    without a word. A new run refuses it; naming its tokenizer runs; a folder `hacpo export`
    wrote for a char agent (its tokenizer is the char tokenizer's) and a folder with no
    tokenizer file run too. A stored run's config still loads (eval, export, resume)."""
    import json

    from hacpo.engine.run_config import check_new_run_names
    d = tmp_path / "smollm2"
    d.mkdir()
    (d / "config.json").write_text("{}")
    over = {"agents.0.policy.kind": "hf", "agents.0.policy.path": str(d)}
    check_new_run_names(load_config("tiny3", overrides=over))
    (d / "tokenizer.json").write_text("{}")
    cfg = load_config("tiny3", overrides=over)
    assert cfg.agents[0].policy.tokenizer == "char"
    with pytest.raises(ValueError, match=rf"^agent 'char': policy.path='{d}' holds its own "
                                         rf"tokenizer \(tokenizer.json\) but policy.tokenizer "
                                         rf"is 'char' \(the default\): the model would read "
                                         rf"character ids; set policy.tokenizer='{d}'$"):
        check_new_run_names(cfg)
    check_new_run_names(load_config("tiny3", overrides={**over,
                                                        "agents.0.policy.tokenizer": str(d)}))
    (d / "hacpo_export.json").write_text(json.dumps({"tokenizer": {"name": "char"}}))
    check_new_run_names(load_config("tiny3", overrides=over))
