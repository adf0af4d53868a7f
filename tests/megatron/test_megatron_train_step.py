"""``MegatronPolicy.train_step`` around megatron-core's optimizers (one CPU rank, gloo):

- non-finite gradients take no step: a clear RuntimeError, the weights and the optimizer state
  unchanged (megatron's fp32 optimizer would step on NaN gradients and write NaN into every
  weight), and the next finite step runs as on a fresh optimizer;
- fp16 weights: the loss is multiplied by megatron's loss scale in the backward
  (``grad_scale_func``) before the optimizer divides the gradients by it, so the step is the
  fp32 step (without it every gradient was 1/2^32 of its value and the weights did not move);
- ``clip_grad`` clips by megatron's global grad norm;
- fp16 with megatron's dynamic loss scaler (the library default, from 2^32): an overflowing
  step is skipped and reported (``step_skipped``, ``loss_scale``) while the scaler lowers the
  scale, until steps happen; a non-finite loss, or an overflow at a constant scale, raises
  and changes nothing; megatron's grad norm is fp32 (finite above fp16's 65504).

The CUDA calls megatron-core makes are patched in ``_cpu_megatron`` (test helper only).
"""
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from tests.megatron import _workers as W  # noqa: E402
from tests.megatron._cpu_megatron import run_single  # noqa: E402

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


def _nan_loss(lp, mb):
    return lp.sum() * float("nan"), {}


def _nonfinite_worker(rank, world):
    from megatron.core import parallel_state as ps

    pol = W._policy_dtype(1, torch.float32)
    opt = pol.build_optimizer(lr=0.05, optimizer="adam")
    mbs = W.step_microbatches(pol.arch.vocab_size, 0, W.B, 2)
    before = {k: v.clone() for k, v in pol.local_state().items()}
    with pytest.raises(RuntimeError, match=r"step was skipped: non-finite loss \(nan in "
                                           r"micro-batch 0 of this rank\); the weights, the "
                                           r"optimizer state and the loss scale are unchanged"):
        pol.train_step(opt, mbs, _nan_loss)
    after_nan = {k: v.clone() for k, v in pol.local_state().items()}
    state_after_nan = len(opt.optimizer.state)
    pol.train_step(opt, mbs, W.sgd_loss)             # the next finite step
    stepped = {k: v.clone() for k, v in pol.local_state().items()}
    ps.destroy_model_parallel()
    # the same finite step on a fresh policy and optimizer
    fresh = W._policy_dtype(1, torch.float32)
    opt = fresh.build_optimizer(lr=0.05, optimizer="adam")
    fresh.train_step(opt, mbs, W.sgd_loss)
    ref = {k: v.clone() for k, v in fresh.local_state().items()}
    ps.destroy_model_parallel()
    return before, after_nan, state_after_nan, stepped, ref


def test_nonfinite_gradients_take_no_step():
    before, after_nan, n_state, stepped, ref = run_single(_nonfinite_worker)
    for k in before:
        assert torch.equal(after_nan[k], before[k]), f"{k} changed by the skipped step"
    assert n_state == 0, "Adam state was created by the skipped step"
    moved = max((stepped[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-2, "the finite step did not move the weights"
    for k in ref:          # Adam's first step: the skipped one left no moment or step count
        torch.testing.assert_close(stepped[k], ref[k], atol=1e-6, rtol=0, msg=k)


def _sgd_step_worker(rank, world, dtype, clip, initial_loss_scale=2.0 ** 32):
    from megatron.core import parallel_state as ps

    pol = W._policy_dtype(1, dtype)
    opt = pol.build_optimizer(lr=0.5, optimizer="sgd", clip_grad=clip,
                              initial_loss_scale=initial_loss_scale)
    mbs = W.step_microbatches(pol.arch.vocab_size, 0, W.B, 2)
    before = pol.local_state()[FC1].float().clone()
    pol.train_step(opt, mbs, W.sgd_loss)
    norm = float(opt.get_grad_norm())        # of the unclipped gradients megatron holds
    update = pol.local_state()[FC1].float() - before
    scale = float(opt.get_loss_scale())
    ps.destroy_model_parallel()
    return update, norm, scale


def test_fp16_step_scales_the_loss_and_equals_the_fp32_step():
    ref, ref_norm, _ = run_single(_sgd_step_worker, torch.float32, 0.0)
    # megatron's dynamic scaler from 2^10 (its default 2^32 overflows fp16: no step)
    got, norm, scale = run_single(_sgd_step_worker, torch.float16, 0.0, 2.0 ** 10)
    assert scale == 2.0 ** 10
    assert ref.abs().max().item() > 5e-2         # SGD with lr 0.5 moves the weights
    # fp16 forward / backward (and the fp16 weights' rounding, ~5e-4 at these magnitudes) vs
    # fp32: seen 1e-3 of a 0.08 update; unscaled gradients (1/2^32) gave an update of 0
    torch.testing.assert_close(got, ref, atol=5e-3, rtol=0)
    assert abs(norm - ref_norm) < 1e-2 * ref_norm, (norm, ref_norm)


def test_clip_grad_clips_by_the_global_norm():
    free, norm, _ = run_single(_sgd_step_worker, torch.float32, 0.0)
    clip = norm / 4
    clipped, _, _ = run_single(_sgd_step_worker, torch.float32, clip)
    torch.testing.assert_close(clipped, free * (clip / (norm + 1e-6)), atol=1e-6, rtol=1e-5)


def _scaler_states(opt) -> list:
    """(scale, growth tracker, hysteresis tracker) of each chained optimizer's grad scaler."""
    from hacpo.models.megatron.policy import chained

    return [(float(o.grad_scaler.scale), getattr(o.grad_scaler, "_growth_tracker", None),
             getattr(o.grad_scaler, "_hysteresis_tracker", None)) for o in chained(opt)]


def _fp16_worker(rank, world, plan, loss_scale=None):
    """fp16 weights, SGD lr 0.5, megatron's scaler (``loss_scale`` None: dynamic from 2^32).
    ``plan``: one loss multiplier per step (nan: a NaN loss). Returns per step
    ("ok", last_step, metrics' step keys, max |update| of FC1) or ("raised", message, the
    scaler's state before and after)."""
    from megatron.core import parallel_state as ps

    pol = W._policy_dtype(1, torch.float16)
    opt = pol.build_optimizer(lr=0.5, optimizer="sgd", loss_scale=loss_scale)
    mbs = W.step_microbatches(pol.arch.vocab_size, 0, W.B, 2)
    res = []
    for mult in plan:
        def loss_fn(lp, mb, mult=mult):
            loss, met = W.sgd_loss(lp, mb)
            return loss * mult, met

        before = pol.local_state()[FC1].float().clone()
        state = _scaler_states(opt)
        try:
            out = pol.train_step(opt, mbs, loss_fn)
        except RuntimeError as e:
            res.append(("raised", str(e), state, _scaler_states(opt),
                        torch.equal(pol.local_state()[FC1].float(), before)))
            continue
        update = pol.local_state()[FC1].float() - before
        res.append(("ok", dict(pol.last_step),
                    [{k: m[k] for k in ("step_skipped", "loss_scale")} for m in out], update))
    ps.destroy_model_parallel()
    return res


def test_fp16_dynamic_scaler_skips_overflows_then_steps():
    ref, _, _ = run_single(_sgd_step_worker, torch.float32, 0.0)
    n = 20
    res = run_single(_fp16_worker, [1.0] * n + [float("nan"), 1.0])
    assert all(r[0] == "ok" for r in res[:n]), [r[:2] for r in res[:n]]
    steps = [r[1] for r in res[:n]]
    # from 2^32 the loss overflows fp16: skipped, reported, the weights untouched; the scale
    # holds once (megatron's hysteresis of 2), then halves at each overflow (seen: 16 skips,
    # down to 2^17)
    assert res[0][2] == [{"step_skipped": True, "loss_scale": 2.0 ** 32}] * 2
    first = next(i for i, s in enumerate(steps) if not s["step_skipped"])
    assert first > 2
    for i in range(first):
        assert steps[i]["step_skipped"] and res[i][3].abs().max() == 0, i
        assert steps[i]["loss_scale"] == 2.0 ** (32 - i), (i, steps[i])
    # the first applied step is the fp32 step (as test_fp16_step_scales_the_loss_...)
    torch.testing.assert_close(res[first][3], ref, atol=5e-3, rtol=0)
    # then (SGD with lr 0.5 grows the gradients) a step is applied at the scale reached, or
    # overflows again, is skipped and halves it
    applied = 0
    for i in range(first, n):
        prev = steps[i - 1]["loss_scale"]
        assert res[i][2] == [{k: steps[i][k] for k in ("step_skipped", "loss_scale")}] * 2
        if steps[i]["step_skipped"]:
            assert res[i][3].abs().max() == 0 and steps[i]["loss_scale"] == prev / 2, i
        else:
            applied += 1
            assert res[i][3].abs().max() > 1e-2, f"step {i} did not move the weights"
            assert steps[i]["loss_scale"] == prev and 0 < steps[i]["grad_norm"] < 1e3, i
    assert applied >= 2, steps
    # a NaN loss is an error even with a dynamic scaler; the scaler's state is kept
    kind, msg, before, after, unchanged = res[n]
    assert kind == "raised" and "non-finite loss (nan in micro-batch 0" in msg, res[n]
    assert before == after and unchanged
    assert res[n + 1][0] == "ok"


def test_fp16_constant_scale_overflow_raises_and_norm_above_fp16_max_is_finite():
    # a constant scale of 1 (the trainer's): 1e5 x the loss gives gradients of norm ~4e5,
    # above fp16's 65504, whose elements are finite in fp16: megatron's fp32 norm of its fp32
    # main gradients is finite and the step applies; 1e6 x overflows fp16 gradients: an error
    _, ref_norm, _ = run_single(_sgd_step_worker, torch.float32, 0.0)
    res = run_single(_fp16_worker, [1e6, 1e5], 1.0)      # the error leaves the weights as is
    kind, msg, before, after, unchanged = res[0]
    assert kind == "raised" and "the fp16 loss scaler (constant scale 1.0) found inf/NaN " \
        "gradients; the weights, the optimizer state and the loss scale are unchanged" in msg
    assert unchanged and before == after
    assert res[1][0] == "ok", res
    norm = res[1][1]["grad_norm"]
    # fp16's forward and backward vs fp32: seen 2.5e-4 relative
    assert norm > 65504 and norm == pytest.approx(1e5 * ref_norm, rel=1e-2), (norm, ref_norm)
    assert not res[1][1]["step_skipped"] and res[1][1]["loss_scale"] == 1.0
    assert res[1][3].abs().max() > 1e2                  # SGD lr 0.5 on gradients x 1e5


def test_loss_fn_metrics_may_not_use_the_step_keys():
    def worker(rank, world):
        from megatron.core import parallel_state as ps

        pol = W._policy_dtype(1, torch.float32)
        opt = pol.build_optimizer(lr=0.5, optimizer="sgd")
        mbs = W.step_microbatches(pol.arch.vocab_size, 0, W.B, 2)
        with pytest.raises(ValueError, match=r"loss_fn's metrics use \['loss_scale'\]"):
            pol.train_step(opt, mbs, lambda lp, mb: (W.sgd_loss(lp, mb)[0],
                                                     {"loss_scale": 1.0}))
        ps.destroy_model_parallel()

    run_single(worker)


def _pp2_nan_loss_worker(rank, world, out_dir):
    """PP=2 (fp32): a NaN loss on the last stage; each rank writes the error it raised."""
    _, pol = W._policy(("qwen2", True), 1, 2)
    opt = pol.build_optimizer(lr=0.5, optimizer="sgd")
    mbs = W.step_microbatches(pol.arch.vocab_size, 0, W.B, 2)
    before = {k: v.clone() for k, v in pol.local_state().items()}
    try:
        pol.train_step(opt, mbs, _nan_loss)
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    same = all(torch.equal(v, before[k]) for k, v in pol.local_state().items())
    torch.save({"msg": msg, "unchanged": same}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.multiprocess
def test_nan_loss_is_an_error_on_every_pipeline_stage(tmp_path):
    from tests.megatron._cpu_megatron import spawn

    spawn(_pp2_nan_loss_worker, 2, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # only the last stage computes the loss; the first learns of it from the others
    assert "non-finite loss (in a micro-batch of another rank)" in got[0]["msg"], got
    assert "non-finite loss (nan in micro-batch 0 of this rank)" in got[1]["msg"], got
    assert all(g["unchanged"] for g in got), got
