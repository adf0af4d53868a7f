"""Setup mistakes of megatron trainer groups that the rank processes would find only after Ray
started (each rank with a long traceback, or a placement group waiting for GPUs until its
timeout) are checked in the driver first:

- ranks on ``parallel.device=cuda`` need a GPU each: the cluster's count is checked before any
  placement group is asked for (a stand-in cluster of CPUs only, no Ray);
- ``trainer_setup_hook`` must load in the driver (its module imports and has the function) and
  ``parallel.transformer_impl=transformer_engine`` must find transformer_engine installed: both
  one-line errors of ``hacpo train`` (exit 2) before Ray starts and before the warm-up.
"""
import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from hacpo.engine.errors import is_user_error  # noqa: E402
from hacpo.engine.run_config import load_config  # noqa: E402
from hacpo.launch import megatron_trainer  # noqa: E402
from hacpo.launch.cli import main  # noqa: E402
from hacpo.launch.ray_cluster import RayCluster  # noqa: E402
from hacpo.models.policy import build_policy  # noqa: E402

from ._megatron_cpu import HOOK  # noqa: E402

import ray  # noqa: E402

HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2}


def _agents(par: dict) -> list[dict]:
    """m1: a tiny HF Llama as a megatron group laid out as ``par``; t1: a plain torch agent."""
    pol = {"kind": "hf", "arch": "llama", "tokenizer": "char", "reduce_vocab": False,
           "hf_config": HF}
    return [{"policy": {**pol, "name": "m1"}, "trainer": "megatron", "parallel": par},
            {"policy": {**pol, "name": "t1", "seed": 2}}]


def _cfg(tmp_path, par: dict, **over):
    return load_config("tiny3", overrides={
        "agents": _agents(par), "trainer_backend": "ray", "trainer_setup_hook": HOOK,
        "threads": 1, "out_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache"),
        **over})


class _Reserved(Exception):
    pass


class _CPUsOnly(RayCluster):
    """A cluster of 8 CPUs and ``gpus`` GPUs that grants no placement group (asking for one
    raises _Reserved)."""

    def __init__(self, gpus: int):
        super().__init__("stand-in:6379", owned=False, connected_here=False)
        self.gpus, self.closed = gpus, False

    def resources(self):
        return {"CPU": 8.0, **({"GPU": float(self.gpus)} if self.gpus else {})}

    def reserve(self, bundles, **kw):
        raise _Reserved(bundles)

    def shutdown(self):
        self.closed = True


@pytest.mark.parametrize("gpus", [0, 1])
def test_ranks_on_cuda_without_enough_gpus_are_an_error_before_any_placement_group(
        tmp_path, monkeypatch, gpus):
    cfg = _cfg(tmp_path, {"tp": 2, "device": "cuda"})
    cluster = _CPUsOnly(gpus)
    monkeypatch.setattr(megatron_trainer, "connect", lambda *a, **k: cluster)
    policies = [build_policy(a.policy) for a in cfg.agents]
    with pytest.raises(RuntimeError, match=r"^parallel.device='cuda': the megatron trainer ranks "
                                           r"need 2 GPUs \(m1: 2 ranks x 1 GPU\) but the Ray "
                                           rf"cluster at stand-in:6379 has {gpus}; lower "
                                           r"tp/pp/dp, set parallel.device=cpu, or add GPUs$") as e:
        megatron_trainer.MegatronAgents(cfg, policies)
    assert is_user_error(e.value) and cluster.closed


def test_ranks_on_cuda_with_their_gpus_go_on_to_their_placement_group(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, {"tp": 2, "device": "cuda"})
    monkeypatch.setattr(megatron_trainer, "connect", lambda *a, **k: _CPUsOnly(2))
    policies = [build_policy(a.policy) for a in cfg.agents]
    with pytest.raises(_Reserved):
        megatron_trainer.MegatronAgents(cfg, policies)


def _train_fails(tmp_path, capsys, monkeypatch, argv: list[str]) -> str:
    """``hacpo train`` with ``argv``: exit 2 and one line, before Ray or the warm-up starts
    (nothing is left in the run directory); returns that line."""
    from hacpo.engine import build

    monkeypatch.delenv("HACPO_TRACEBACK", raising=False)
    monkeypatch.setattr(build, "warm_start", lambda *a, **k: pytest.fail("the warm-up ran"))
    y = tmp_path / "run.yaml"
    y.write_text(f"agents: {json.dumps(_agents({'tp': 2}))}\n")
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny3", "--config", str(y), "--out-dir", str(out),
                 "--set", "trainer_backend=ray", f"trainer_setup_hook={HOOK}", "threads=1",
                 f"cache_dir={tmp_path / 'cache'}", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hacpo train: error: ") and err.count("\n") == 2, err
    assert not ray.is_initialized() and not out.exists()
    return err.splitlines()[0]


def test_a_setup_hook_that_cannot_load_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    line = _train_fails(tmp_path, capsys, monkeypatch,
                        ["trainer_setup_hook=tests.launch._megatron_cpu:aply"])
    assert ("trainer_setup_hook 'tests.launch._megatron_cpu:aply' cannot be loaded in the "
            "driver (the ranks import it the same way): AttributeError: module "
            "'tests.launch._megatron_cpu' has no attribute 'aply'") in line, line
    line = _train_fails(tmp_path, capsys, monkeypatch, ["trainer_setup_hook=tests.nope:apply"])
    assert "'tests.nope:apply' cannot be loaded in the driver" in line
    assert "ModuleNotFoundError: No module named 'tests.nope'" in line, line
    line = _train_fails(tmp_path, capsys, monkeypatch,
                        ["trainer_setup_hook=tests.launch._megatron_cpu:HOOK"])
    assert "'tests.launch._megatron_cpu:HOOK' names a str, not a function" in line, line


def test_transformer_engine_where_it_is_missing_is_a_one_line_error(tmp_path, capsys,
                                                                    monkeypatch):
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    line = _train_fails(tmp_path, capsys, monkeypatch,
                        ["agents.0.parallel.device=cuda",
                         "agents.0.parallel.transformer_impl=transformer_engine"])
    assert line.endswith("agent 'm1': parallel.transformer_impl='transformer_engine' but "
                         "transformer_engine is not importable here; install it (CUDA only) "
                         "or set parallel.transformer_impl=local"), line
