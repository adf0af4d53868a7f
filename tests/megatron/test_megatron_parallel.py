"""megatron-core TP x PP on CPU/gloo beyond one axis at a time: at TP=2 x PP=2 (4 ranks) the
per-token log-probs equal TP=1/PP=1, the gradients of a token-level loss (gathered back to HF
names through ``megatron_to_hf``) equal the HF model's autograd gradients, and one
``train_step`` with megatron-core's optimizer gives the same weights as at TP=1/PP=1; the same
step at PP=2 alone (2 ranks, megatron's 1F1B schedule over 2 micro-batches). The vocabularies
are odd, so at TP=2 megatron pads them by one row (build.py): the padded rows must stay out of
the log-probs, get zero gradient and stay zero, and HF weights come back unpadded; the same
at TP=2 alone for the tied model (its output layer is the padded embedding itself).

Both ways of turning hidden states into log-probs (``lm_head``) are checked against the HF
gradients: the TP=1 reference and TP=2 alone use megatron's output layer ("logits"), TP=2 x PP=2
and PP=2 the fused chunked kernel on the hidden states ("fused", the default). Every run also
scores only some positions (``positions`` / ``mask``, as the trainer asks for the response
tokens) in micro-batches of different shapes (3 rows cut to 8 positions, 1 row cut to 7):
they must equal the whole-sequence log-probs there and be 0 where masked out.

(TP=2 and PP=2 log-probs alone and DP=2 training are in test_megatron_policy.py.)
The CUDA calls megatron-core makes are patched in ``_cpu_megatron`` (test helper only).
"""
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from tests.megatron import _workers as W  # noqa: E402
from tests.megatron._cpu_megatron import run_single, spawn  # noqa: E402

# qwen3 tied: qk-norm (megatron all-reduces its grads over TP), head_dim != hidden/heads, the
# tied embedding kept in sync between the first and last PP stage; qwen2 untied: qkv bias and a
# separate output layer. Both vocabularies are odd (padded to 102 / 92 rows at TP=2); the even
# one (no padding) is checked at TP=2 in test_megatron_policy.py.
CASES = [("qwen3", True, 101), ("qwen2", False, 91)]
OPTS = ("sgd", "adam")
LR = 0.5          # W.parallel_step_worker's learning rate
MICRO = W.B // 2  # 2 micro-batches per step (1F1B has a warm-up and a steady phase at PP=2)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """TP=1 PP=1 DP=1 in this process: {case: {"lp", "same", "before", "grads", "after"}}."""
    path = tmp_path_factory.mktemp("single") / "single.pt"
    run_single(W.parallel_step_worker, 1, 1, MICRO, CASES, OPTS, str(path), "logits")
    return torch.load(path)


@pytest.fixture(scope="module")
def hf_grads():
    """HF autograd gradients of the same loss over the whole batch (the reference)."""
    return {case: W.hf_grads(W.case_model(case)) for case in CASES}


def _check_grads(grads, ref, case):
    assert grads.keys() == ref.keys(), f"{case}: {grads.keys() ^ ref.keys()}"
    for k in ref:
        # Log-probs agree to ~1e-6 (fp32, other op order); the gradients are fp32 sums over the
        # same terms in another order: seen 1.4e-6 of each tensor's largest entry (largest
        # entries 0.1-0.4). 1e-5 of the largest entry is 7x that, while any mapping or scaling
        # error (a missing TP all-reduce of the qk-norm grads, a tied copy not summed, a factor
        # 1/num_microbatches or 1/tp) moves gradients by a sizeable fraction of that entry.
        scale = ref[k].abs().max().item()
        assert scale > 0, f"{case} {k}: zero reference gradient"
        torch.testing.assert_close(grads[k], ref[k], atol=1e-5 * scale, rtol=0,
                                   msg=f"{case} {k}")


def _check_positions(res, case):
    """The positions-only log-probs are the whole-sequence ones there (the same rows through the
    same reductions, only fewer of them: a GEMM over fewer rows may round differently, so 1e-6)
    and exactly 0 where the mask is False."""
    pos, mask = W.score_positions()
    at = res["lp"].gather(1, pos)
    assert at.shape == res["lp_at"].shape
    torch.testing.assert_close(res["lp_at"][mask], at[mask], atol=1e-6, rtol=0, msg=str(case))
    assert (res["lp_at"][~mask] == 0).all(), f"{case}: a masked-out position was scored"
    assert (at[mask] != 0).all(), f"{case}: a zero log-prob would hide the mask check"
    # packed by a token budget (rows out of order, see _workers): the same, in row order
    torch.testing.assert_close(res["lp_tok"], res["lp_at"], atol=1e-6, rtol=0, msg=str(case))


def _check_padding(par, case, tp):
    """The padded vocabulary rows (embedding and, untied or at PP>1, output layer) got zero
    gradient and are still zero after the SGD and Adam steps."""
    for name in OPTS:
        rows, grad, weight = par["padding"][name]
        assert rows > 0 if tp > 1 else rows == 0, f"{case} {name}: {rows} padded rows"
        assert grad == 0.0 and weight == 0.0, f"{case} {name}: padded rows grad {grad} / " \
                                              f"weight {weight}"


def _check_step(par, one, case):
    before = one["before"]
    for name in OPTS:
        a, b = one["after"][name], par["after"][name]
        assert a.keys() == b.keys() == before.keys()
        g = one["grads"][name]
        if name == "sgd":
            # update = -lr * grad: an exact function of the gradient (its error ~3e-7 seen)
            biggest = 0.0
            for k in before:
                d1, d2 = a[k] - before[k], b[k] - before[k]
                biggest = max(biggest, d1.abs().max().item())
                torch.testing.assert_close(d2, d1, atol=1e-6, rtol=0, msg=f"{case} sgd {k}")
            assert biggest > 1e-2, f"{case}: the sgd step did not change the weights"
        else:
            # Adam's first step is lr * g / (|g| + eps): about lr * sign(g), so entries whose
            # gradient is at the fp32 rounding level (|g| ~ 1e-7) may flip. Where |g| > 1e-4
            # (300x the worst gradient difference seen) a rounding error dg moves the update by
            # lr * eps * dg / g^2 < 1e-8: compare there to 1e-6, and require that this covers
            # most entries so that the check cannot pass vacuously.
            checked = total = 0
            for k in before:
                sel = g[k].abs() > 1e-4
                checked, total = checked + int(sel.sum()), total + sel.numel()
                torch.testing.assert_close((b[k] - before[k])[sel], (a[k] - before[k])[sel],
                                           atol=1e-6, rtol=0, msg=f"{case} adam {k}")
                assert (b[k] - before[k]).abs().max().item() <= LR * (1 + 1e-5)
            assert checked > 0.8 * total, f"{case}: only {checked}/{total} entries compared"


@pytest.mark.multiprocess
def test_tp2_pp2_logprobs_gradients_and_step(single, hf_grads, tmp_path):
    path = tmp_path / "tp2pp2.pt"
    spawn(W.parallel_step_worker, 4, 2, 2, MICRO, CASES, OPTS, str(path))
    par = torch.load(path)
    for case in CASES:
        one, res = single[case], par[case]
        assert one["same"] and res["same"], f"{case}: gathered weights differ from the HF ones"
        assert one["same_first"] and res["same_first"], f"{case}: rank 0's weights differ"
        assert one["same_units"] and res["same_units"], f"{case}: streamed weights differ"
        # vocab-parallel log-softmax, row-parallel all-reduces and fp32 stage-to-stage sends only
        # reorder fp32 sums (seen: 9.5e-7); 1e-5 is the requirement
        torch.testing.assert_close(res["lp"], one["lp"], atol=1e-5, rtol=0, msg=str(case))
        _check_positions(one, case)
        _check_positions(res, case)
        for name in OPTS:
            _check_grads(one["grads"][name], hf_grads[case], case)   # the TP=1 path itself
            _check_grads(res["grads"][name], hf_grads[case], case)
        _check_step(res, one, case)
        _check_padding(res, case, 2)
        _check_padding(one, case, 1)


@pytest.mark.multiprocess
def test_tp2_odd_vocab_step_equals_tp1(single, hf_grads, tmp_path):
    """TP=2 alone (PP=1) with the tied qwen3 (V=101 padded to 102): the output layer is the
    padded embedding itself, so its padded row sees both the lookup and the logits' gradient."""
    path = tmp_path / "tp2.pt"
    case = CASES[0]
    spawn(W.parallel_step_worker, 2, 2, 1, MICRO, [case], OPTS, str(path), "logits")
    one, res = single[case], torch.load(path)[case]
    _check_positions(res, case)
    assert res["same"] and res["same_first"], f"{case}: TP-gathered weights differ"
    assert res["same_units"], f"{case}: TP-streamed weights differ"
    # as at TP=2 x PP=2 (seen: ~1e-6)
    torch.testing.assert_close(res["lp"], one["lp"], atol=1e-5, rtol=0, msg=str(case))
    for name in OPTS:
        _check_grads(res["grads"][name], hf_grads[case], case)
    _check_step(res, one, case)
    _check_padding(res, case, 2)


@pytest.mark.multiprocess
def test_pp2_step_equals_pp1(single, hf_grads, tmp_path):
    path = tmp_path / "pp2.pt"
    spawn(W.parallel_step_worker, 2, 1, 2, MICRO, CASES, OPTS, str(path))
    par = torch.load(path)
    for case in CASES:
        one, res = single[case], par[case]
        assert res["same"], f"{case}: PP-gathered weights differ from the HF ones"
        assert res["same_first"], f"{case}: PP-gathered weights on rank 0 differ"
        assert res["same_units"], f"{case}: PP-streamed weights on rank 0 differ"
        torch.testing.assert_close(res["lp"], one["lp"], atol=1e-6, rtol=0, msg=str(case))
        _check_positions(res, case)
        for name in OPTS:
            _check_grads(res["grads"][name], hf_grads[case], case)
        _check_step(res, one, case)


SELECTIVE = {"recompute": "selective", "modules": ["core_attn", "mlp"]}
FULL = {"recompute": "full", "num_layers": 1}


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp, pp, lm_head, cases, recompute", [
    # 4 ranks, both models, the fused head on gathered hidden states; the attention core and
    # the MLP of every layer recomputed in the backward
    (2, 2, "fused", CASES, SELECTIVE),
    # megatron's output layer gathers the sequence itself; every layer recomputed whole
    (2, 1, "logits", CASES[:1], FULL),
], ids=["tp2-pp2-fused-selective", "tp2-logits-full"])
def test_sequence_parallel_and_recompute_step_equals_tp1(single, hf_grads, tmp_path, tp, pp,
                                                         lm_head, cases, recompute):
    """Megatron's sequence parallelism (build.py): the norms and residuals hold S/tp positions
    per TP rank, so every micro-batch is padded to a multiple of tp (the scored micro-batches
    of 7 and 1 positions, see _workers, are odd) and the norm weights' partial gradients are
    summed over TP; with activation recomputation (``recompute``) the parts of each layer run
    again in the backward. Log-probs, gradients and one step equal TP=1 as without them."""
    path = tmp_path / "sp.pt"
    spawn(W.parallel_step_worker, tp * pp, tp, pp, MICRO, cases, OPTS, str(path), lm_head,
          True, recompute)
    par = torch.load(path)
    n_micro = W.B // MICRO
    for case in cases:
        one, res = single[case], par[case]
        # rank 0's first norm held half of the positions of each micro-batch (2 rows x 8)
        assert res["norm_inputs"] == [(W.S // tp, MICRO, 64)] * 2, res["norm_inputs"]
        assert one["norm_inputs"] == [(W.S, MICRO, 64)] * 2, one["norm_inputs"]
        # in the training step each part ran once per micro-batch, and again when recomputed
        # (the input norm only when the whole layer is)
        assert one["train_calls"] == dict.fromkeys(("norm", "core_attn", "mlp"), n_micro)
        again = {"norm": 2 * n_micro if recompute is FULL else n_micro,
                 "core_attn": 2 * n_micro, "mlp": 2 * n_micro}
        assert res["train_calls"] == again, res["train_calls"]
        assert res["same"] and res["same_first"] and res["same_units"], \
            f"{case}: weights gathered under sequence parallelism differ from the HF ones"
        # as at TP=2 x PP=2 without them (seen: ~1e-6)
        torch.testing.assert_close(res["lp"], one["lp"], atol=1e-5, rtol=0, msg=str(case))
        _check_positions(res, case)
        for name in OPTS:
            _check_grads(res["grads"][name], hf_grads[case], case)
        _check_step(res, one, case)
        _check_padding(res, case, tp)
