"""``MegatronPolicy.train_step`` around megatron-core's optimizers (one CPU rank, gloo):

- non-finite gradients take no step: a clear RuntimeError, the weights and the optimizer state
  unchanged (megatron's fp32 optimizer would step on NaN gradients and write NaN into every
  weight), and the next finite step runs as on a fresh optimizer;
- fp16 weights: the loss is multiplied by megatron's loss scale in the backward
  (``grad_scale_func``) before the optimizer divides the gradients by it, so the step is the
  fp32 step (without it every gradient was 1/2^32 of its value and the weights did not move);
- ``clip_grad`` clips by megatron's global grad norm.

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
    with pytest.raises(RuntimeError, match=r"step was skipped: non-finite gradients \(grad "
                                           r"norm nan\); the weights and the optimizer state "
                                           r"are unchanged"):
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
