"""Command line: the toy demo runs and improves the agents; config errors are clear."""
import json

import pytest

from hacpo.launch.bandit_demo import run
from hacpo.launch.cli import main


def test_bandit_demo_learns():
    lines = []
    acc = run("hacpo", steps=15, agents=2, prompts=16, echo=lines.append)
    first = [float(x) for x in lines[0].split(":")[1].split()]
    assert len(acc) == 2 and all(a > f for a, f in zip(acc, first))


def test_train_cli_bad_override_is_clear(capsys, monkeypatch):
    """Config errors of the run commands are one line on stderr and exit status 2 (with
    HACPO_TRACEBACK=1 the exception itself)."""
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    for cmd in ("train", "compare", "profile"):
        assert main([cmd, "--preset", "tiny3", "--set", "rollout.gsize=3"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hacpo {cmd}: error: unknown config key 'rollout.gsize'"), err
        assert "Traceback" not in err
    assert main(["train", "--preset", "big"]) == 2
    assert "unknown run preset 'big'" in capsys.readouterr().err
    # --set given twice: both apply (the first one's bad key is reported)
    assert main(["train", "--preset", "tiny3", "--set", "rollout.gsize=3", "--set",
                 "steps=1"]) == 2
    assert "unknown config key 'rollout.gsize'" in capsys.readouterr().err
    monkeypatch.setenv("HACPO_TRACEBACK", "1")
    with pytest.raises(ValueError, match="unknown run preset 'big'"):
        main(["train", "--preset", "big"])


def test_algorithm_flag_keeps_the_run_budget_and_set_overrides(tmp_path):
    """``--algorithm`` puts the run preset under another algorithm as compare does: the
    preset's minibatch count stays, and the user's algorithm overrides (YAML, --set) win."""
    import argparse

    from hacpo.launch.cli import train_config

    def cfg(*extra, config=None, algorithm=None):
        args = argparse.Namespace(preset="default", config=config, algorithm=algorithm,
                                  steps=None, out_dir=None, set=list(extra))
        return train_config(args)

    plain, keep = cfg()
    assert (plain.algorithm.name, plain.algorithm.num_minibatches, keep) == ("hacpo", 2, {})
    g, _ = cfg(algorithm="gspo")
    assert (g.algorithm.name, g.algorithm.num_minibatches) == ("gspo", 2)
    y = tmp_path / "c.yaml"
    y.write_text("algorithm:\n  capability: {window: 3}\n")
    h, keep = cfg("algorithm.loss.alpha=0.5", config=str(y), algorithm="hacpo-table5")
    assert keep == {"loss.alpha": 0.5, "capability.window": 3}
    a = h.algorithm
    assert (a.loss.alpha, a.capability.window, a.loss.cross_clip_delta, a.num_minibatches) \
        == (0.5, 3, 0.8, 2)


def test_algorithm_settings_kept_are_the_users_changes(tmp_path):
    """A saved config.json as --config keeps only what differs from the run preset (so
    compare / profile can take it), and a setting that contradicts an ablation preset is an
    error, never two identical "algorithms"."""
    import argparse

    from hacpo.engine.compare import with_algorithm
    from hacpo.engine.run_config import load_config
    from hacpo.launch.cli import train_config

    saved = load_config("default", overrides={"algorithm.loss.alpha": 0.5}).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved))
    args = argparse.Namespace(preset="default", config=str(path), algorithm="gspo", steps=None,
                              out_dir=None, set=[])
    cfg, keep = train_config(args)
    assert keep == {"loss.alpha": 0.5} and cfg.algorithm.name == "gspo"
    with pytest.raises(ValueError, match=r"algorithm.loss.alpha=0.5 contradicts the algorithm "
                                         r"preset 'hacpo-alpha0', which sets loss.alpha=0.0"):
        with_algorithm(cfg, "hacpo-alpha0", keep)
    assert with_algorithm(cfg, "hacpo-alpha0", {"loss.alpha": 0}).algorithm.loss.alpha == 0.0
    args.set = ["algorithm.name=grpo"]
    with pytest.raises(ValueError, match="both choose the algorithm"):
        train_config(args)


def test_yaml_and_set_are_checked_together(tmp_path):
    """A config valid only with both the YAML and --set applied loads (not checked half-way)."""
    from hacpo.engine.run_config import load_config

    y = tmp_path / "hf.yaml"
    y.write_text("agents:\n  0: {policy: {arch: llama, hf_config: {num_hidden_layers: 1}}}\n")
    cfg = load_config("tiny3", str(y), {"agents.0.policy.kind": "hf"})
    assert cfg.agents[0].policy.kind == "hf" and cfg.agents[0].policy.arch == "llama"


def test_only_input_errors_are_one_line(tmp_path, monkeypatch, capsys):
    """An error in the run's inputs (here a resume past the run's steps) is one line, exit 2;
    an error raised while training is not the user's and keeps its traceback."""
    from hacpo.engine import trainer

    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    common = ["train", "--preset", "tiny3", "--out-dir", str(tmp_path / "run"), "--set",
              f"cache_dir={tmp_path / 'cache'}", "plots=false", "tensorboard=false"]
    assert main(common + ["steps=1"]) == 0
    capsys.readouterr()
    assert main(common + ["steps=0", "--resume"]) == 2
    assert "the run is past it" in capsys.readouterr().err

    def boom(*a, **k):
        raise ValueError("a bug in a step")
    monkeypatch.setattr(trainer, "_run", boom)
    with pytest.raises(ValueError, match="a bug in a step"):
        main(common + ["steps=2", "--resume"])
