"""Algorithm settings a user sets, found wrong by an exploratory audit: values that pass as
finite Python floats but are infinite in the float32 math are refused when the config loads,
naming the key and the value; a clip setting the chosen cross clip never reads is said so."""
import pytest
import torch

from hacpo.engine import defaults as D
from hacpo.engine import hacpo_policy_loss
from hacpo.engine.compare import with_algorithm
from hacpo.engine.config import MAX_LOG_FLOAT32
from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import unused_algorithm_note


@pytest.mark.parametrize("key,bad,msg", [
    # was "loss.self_clip_low and loss.grpo_clip_low must be < 1": neither which nor the value
    ("algorithm.loss.self_clip_low", "1", r"^loss\.self_clip_low must be in \[0, 1\) .*, "
                                          r"got 1\.0$"),
    ("algorithm.loss.grpo_clip_low", "1.5", r"^loss\.grpo_clip_low must be in \[0, 1\) .*, "
                                            r"got 1\.5$"),
    # 1e39 is inf in float32: was accepted, and every advantage of the run was 0
    ("algorithm.advantage.eps", "1e39", r"^advantage\.eps must be finite and > 0 .*, "
                                        r"got 1e\+39$"),
    # was accepted, then "value cannot be converted to type float without overflow" mid-step
    ("algorithm.loss.max_abs_log_ratio", "1e39", r"^loss\.max_abs_log_ratio must be .*"
                                                 r"<= 88\.72 .*, got 1e\+39$"),
    # exp(100) is inf in float32: the bound let an infinite ratio (a NaN loss) through
    ("algorithm.loss.max_abs_log_ratio", "100", r"^loss\.max_abs_log_ratio .*, got 100\.0$"),
])
def test_an_algorithm_setting_out_of_range_is_refused_at_load(key, bad, msg):
    with pytest.raises(ValueError, match=msg):
        load_config("tiny3", overrides={key: bad})


def test_the_largest_allowed_log_ratio_bound_keeps_the_loss_finite():
    """max_abs_log_ratio at its upper limit (no stricter) loads and still bounds the float32
    ratio: a log-ratio of 1000 gives a finite loss and gradient."""
    cfg = load_config("tiny3", overrides={"algorithm.loss.max_abs_log_ratio": MAX_LOG_FLOAT32,
                                          "algorithm.advantage.eps": str(D.FLOAT32_MAX)})
    L = cfg.algorithm.loss
    new_lp = torch.tensor([0.0, 0.0], requires_grad=True)
    loss, _ = hacpo_policy_loss(new_lp, torch.tensor([-1000.0, -1000.0]),
                                torch.tensor([1.0, -1.0]), torch.tensor([True, False]),
                                torch.ones(2), minibatch_index=0,
                                max_abs_log_ratio=L.max_abs_log_ratio,
                                self_clip_low=L.self_clip_low, self_clip_high=L.self_clip_high)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new_lp.grad).all()


def test_a_cross_clip_setting_the_chosen_cross_clip_never_reads_is_said_unused(tmp_path):
    """`--algorithm hacpo-no-cross-clip --set algorithm.loss.cross_clip_delta=0.5` trained as if
    it was not set, without a word (grpo's settings under hacpo were already said unused)."""
    cfg = load_config("tiny3", overrides={"out_dir": str(tmp_path)})
    none = with_algorithm(cfg, "hacpo-no-cross-clip", {"loss.cross_clip_delta": 0.5,
                                                       "loss.cross_clip_step": 0.1})
    assert unused_algorithm_note(none) == (
        "algorithm.loss.cross_clip_delta=0.5, algorithm.loss.cross_clip_step=0.1: algorithm "
        "hacpo with loss.cross_clip=none never reads these (the run trains as if they were "
        "not set)")
    static = with_algorithm(cfg, "hacpo-static-clip", {"loss.cross_clip_delta": 0.5,
                                                       "loss.cross_clip_step": 0.1})
    assert unused_algorithm_note(static) == (     # static reads delta (its bound 1 - delta)
        "algorithm.loss.cross_clip_step=0.1: algorithm hacpo with loss.cross_clip=static never "
        "reads this (the run trains as if it was not set)")
    stepwise = with_algorithm(cfg, "hacpo", {"loss.cross_clip_delta": 0.5,
                                             "loss.cross_clip_step": 0.1})
    assert unused_algorithm_note(stepwise) is None
