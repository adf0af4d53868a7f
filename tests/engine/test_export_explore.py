"""`hacpo export` used as a user would, where it went wrong: ``--out`` the parent of a run dir
named as one of its agents (README: `hacpo export runs/smollm2 --out ...`, an agent smollm2)
made that agent's folder the run dir itself; the export refused it as existing, said
"--force replaces them", and with --force replaced the run (checkpoint, metrics, config) by
the exported model. Such a folder (the run dir, or one holding it) is refused, --force or
not, with the run untouched; a link there is still replaced itself, not the run it names.
A run's checkpoint.pt that is a dangling link or a folder is said as such, not "holds no
checkpoint.pt (did the run save one?)"."""
import os
import shutil

import pytest

from hacpo.engine.export import export_checkpoint
from hacpo.launch import cli

from .test_export_edges import _quiet, _tree, run  # noqa: F401  (run: the module fixture)

pytest.importorskip("transformers")


@pytest.mark.parametrize("force", [False, True])
def test_an_agent_folder_that_is_the_run_dir_is_refused_and_the_run_kept(  # noqa: F811
        run, tmp_path, force, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(run / "run", runs / "untied")      # a run named as its agent
    before = _tree(runs / "untied")
    argv = ["export", str(runs / "untied"), "--out", str(runs), "--agents", "untied"]
    assert cli.main(argv + (["--force"] if force else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("hacpo export: error: cannot export agent untied to ")
    assert "holds the run it is exported from" in err[0] and "--force" not in err[0]
    assert _tree(runs / "untied") == before
    assert sorted(os.listdir(runs)) == ["untied"]       # no temporary or aside folder


def test_an_agent_folder_holding_the_checkpoint_is_refused(run, tmp_path):  # noqa: F811
    models = tmp_path / "models"
    shutil.copytree(run / "run", models / "g2" / "run1")
    before = _tree(models)
    with pytest.raises(ValueError, match=r"cannot export agent g2 to .*models/g2: that folder "
                                         r"holds the run .*run1\)"):
        export_checkpoint(str(models / "g2" / "run1" / "checkpoint.pt"), str(models),
                          agents=["g2"], overwrite=True, echo=_quiet)
    assert _tree(models) == before


def test_a_link_to_the_run_at_the_agent_folder_is_replaced_not_the_run(  # noqa: F811
        run, tmp_path):
    shutil.copytree(run / "run", tmp_path / "data" / "untied")
    before = _tree(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(tmp_path / "data" / "untied", out / "untied")
    export_checkpoint(str(out / "untied"), str(out), agents=["untied"], overwrite=True,
                      echo=_quiet)
    assert not (out / "untied").is_symlink() and (out / "untied" / "model.safetensors").is_file()
    assert _tree(tmp_path / "data") == before


@pytest.mark.parametrize("what", ["dangling link", "directory"])
def test_a_checkpoint_that_is_no_file_is_named_not_never_saved(tmp_path, what, capsys):
    """A run's checkpoint.pt that is a link to a file not there (a volume not mounted) or a
    folder: said as such, as `--resume` says it, not "holds no checkpoint.pt (did the run
    save one?)" that sends the user looking for a run that never saved one."""
    ck = tmp_path / "run" / "checkpoint.pt"
    ck.parent.mkdir()
    if what == "directory":
        ck.mkdir()
        want = f"checkpoint {ck} is a directory, not a checkpoint file"
    else:
        os.symlink(tmp_path / "unmounted" / "checkpoint.pt", ck)
        want = f"{ck} is a symbolic link to {tmp_path / 'unmounted' / 'checkpoint.pt'}, which"
    for arg in (ck.parent, ck) if what != "directory" else (ck.parent,):   # (a folder: a run)
        assert cli.main(["export", str(arg), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"hacpo export: error: {want}") and "\n" not in err
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_an_agent_folder_holding_another_run_is_refused(run, tmp_path):  # noqa: F811
    """--out a folder of runs (an agent named as one of them): --force replaced that run."""
    out = tmp_path / "runs"
    shutil.copytree(run / "run", out / "g2")
    before = _tree(out)
    with pytest.raises(ValueError, match=r"cannot export agent g2 to .*runs/g2: that folder "
                                         r"holds another run \(.*runs/g2/checkpoint.pt\)"):
        export_checkpoint(str(run / "run"), str(out), agents=["g2"], overwrite=True,
                          echo=_quiet)
    assert _tree(out) == before


def test_an_agent_folder_holding_a_model_the_run_is_built_from_is_refused(tmp_path):
    """--out the folder of the base models, an agent named as its model's folder: --force
    replaced the model the run's eval and --resume build the agent from."""
    from types import SimpleNamespace

    from hacpo.engine.export import _holds_the_run
    models = tmp_path / "models"
    (models / "smollm2").mkdir(parents=True)
    (models / "tok").mkdir()
    run_dir = tmp_path / "run"

    def cfg(path, tokenizer):
        pol = SimpleNamespace(name="smollm2", kind="hf", path=path, tokenizer=tokenizer)
        return SimpleNamespace(agents=[SimpleNamespace(policy=pol)])
    dirs = {"smollm2": str(models / "smollm2")}
    why = _holds_the_run(dirs, str(run_dir / "checkpoint.pt"), str(run_dir),
                         cfg(str(models / "smollm2"), "qwen3"))
    assert why == (f"cannot export agent smollm2 to {models / 'smollm2'}: that folder holds "
                   f"what the run is built from (agent smollm2's policy.path), which writing "
                   f"it would replace (--out chooses another)")
    why = _holds_the_run({"smollm2": str(models)}, str(run_dir / "checkpoint.pt"),
                         str(run_dir), cfg(str(models / "smollm2"), str(models / "tok")))
    assert "(agent smollm2's policy.path, agent smollm2's policy.tokenizer)" in why
    # a tokenizer known by name, a model elsewhere: nothing of the run there
    (tmp_path / "elsewhere").mkdir()
    assert _holds_the_run(dirs, str(run_dir / "checkpoint.pt"), str(run_dir),
                          cfg(str(tmp_path / "elsewhere"), "qwen3")) is None
