"""Package-level contracts: the public API imports, and importing hacpo.engine stays light."""
import subprocess
import sys


def test_engine_import_is_light():
    code = ("import sys, hacpo.engine, hacpo.kernels; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('ray', 'vllm', 'megatron', 'transformers', 'triton')]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_spec_public_api_names():
    from hacpo.engine import (CapabilityTracker, group_advantages, grpo_policy_loss,  # noqa
                              gspo_policy_loss, hacpo_advantages, hacpo_policy_loss,
                              sequence_mean_logprob)
    import inspect
    p = inspect.signature(hacpo_policy_loss).parameters
    assert [k for k in p][:5] == ["new_lp", "old_lp", "advantages", "is_self", "omega"]
    assert p["minibatch_index"].kind is inspect.Parameter.KEYWORD_ONLY
    assert (p["alpha"].default, p["cross_clip"].default, p["cross_clip_delta"].default,
            p["cross_clip_step"].default, p["self_clip_low"].default, p["self_clip_high"].default,
            p["max_abs_log_ratio"].default) == (1.0, "stepwise", 0.2, 0.025, 3e-4, 4e-4, 10.0)
    t = inspect.signature(CapabilityTracker).parameters
    assert (t["window"].default, t["metric"].default, t["minimum"].default,
            t["ratio_min"].default, t["ratio_max"].default) == (5, "positive_rate", 1e-8, 0.1, 10.0)
