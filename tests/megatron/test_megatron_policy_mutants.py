"""``MegatronPolicy`` behaviour the other megatron tests leave out, each found by a mutation
audit of hacpo/models/megatron/policy.py: scoring requests that would silently read the wrong
positions or rows are clear errors; optimizer states (a checkpoint shard, or another layout's
moments) that do not fit this optimizer are clear ValueErrors instead of a wrong or partial
load, and a distributed optimizer's shard restores the fp16 loss scale; DP replicas other than
0 get no weights from the weight pull; micro-batches are cut after their longest row and
packed by the padded tokens sequence parallelism runs; ``from_hf`` passes the vocabulary
padding and the lm_head on.

The CUDA calls megatron-core makes are patched in ``_cpu_megatron`` (test helper only).
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from tests.megatron import _workers as W  # noqa: E402
from tests.megatron._cpu_megatron import run_single, spawn  # noqa: E402


def _more_bad_positions_worker(rank, world):
    """A negative scored position (would read the sequence from its end), positions of fewer
    rows than the targets (would score those rows only) and hidden states of another batch
    size: rank 0 returns each request's ValueError message (None: no error)."""
    hf, pol = W._policy(("llama", True), 1, 1)
    ids, targets = W.batch(pol.arch.vocab_size)
    pos, mask = W.score_positions()
    neg = pos.clone()
    neg[0, 1] = -1                      # scored (mask True)
    calls = [lambda: pol.token_logprobs(ids, targets, positions=neg, mask=mask),
             lambda: pol.logprobs_at(torch.zeros(W.S, W.B, 64), targets, positions=pos[:2],
                                     mask=mask[:2]),
             lambda: pol.logprobs_at(torch.zeros(W.S, W.B + 1, 64), targets)]
    return W.value_error_messages(calls)


def test_more_bad_scoring_requests_are_clear_errors():
    msgs = run_single(_more_bad_positions_worker)
    assert msgs[0] == f"positions must lie in [0, {W.S}), got -1..{W.S - 1}"
    assert msgs[1] == f"positions (2, 3) and mask (2, 3) must both be [{W.B}, T]"
    assert msgs[2] == f"hidden states ({W.S}, {W.B + 1}, 64) are not [{W.S}, {W.B}, H]"


def _expect(call, msg: str) -> None:
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == msg


def _state_errors_worker(rank, world):
    """bf16 weights, megatron's plain optimizer after one Adam step: its shard with an fp32
    parameter of another shape, its moments by name with a moment of another shape or without
    the main weights of a bf16 parameter, or two loss scaler states for one optimizer; then
    fp16 weights with the distributed optimizer (DP=1): a shard of two chained optimizers."""
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron.policy import named_moments

    pol = W._policy_dtype(1, torch.bfloat16)
    opt = pol.build_optimizer(lr=0.05, optimizer="adam")
    pol.train_step(opt, W.step_microbatches(pol.arch.vocab_size, 0, W.B, 2), W.sgd_loss)
    state = W._through_file(pol.optimizer_state(opt))
    fp32 = [g for g in state["fp32_params"][0] if g]
    assert fp32, "the test needs fp32 parameters in the bf16 model (megatron's norms)"
    fp32[0][0] = fp32[0][0][:-1]
    _expect(lambda: pol.load_optimizer_state(opt, state),
            "the optimizer state's fp32 parameters do not match this optimizer's: written "
            "with another layout")

    emb = "embedding.word_embeddings.weight"
    shape = tuple(pol.module.embedding.word_embeddings.weight.shape)
    moments = named_moments(W._through_file(pol.optimizer_state(opt)))
    assert "main" in moments[emb]
    _expect(lambda: pol.load_named_moments(opt, {**moments, emb: {
                **moments[emb], "exp_avg": moments[emb]["exp_avg"][:-1]}}),
            f"optimizer state of {emb!r} has shape ({shape[0] - 1}, {shape[1]}), the "
            f"parameter {shape}")
    _expect(lambda: pol.load_named_moments(opt, {**moments, emb: {
                k: v for k, v in moments[emb].items() if k != "main"}}),
            f"the optimizer state of {emb!r} holds no fp32 main weights, which its fp16 / "
            f"bf16 weights need")
    _expect(lambda: pol.load_named_moments(opt, moments, grad_scalers=[None, None]),
            "2 loss scaler states for 1 chained optimizers")
    ps.destroy_model_parallel()

    pol = W._policy_dtype(1, torch.float16)
    opt = pol.build_optimizer(lr=0.05, optimizer="adam", use_distributed_optimizer=True,
                              initial_loss_scale=2.0 ** 10)
    state = W._through_file(pol.optimizer_state(opt))
    two = {**state, "distributed": state["distributed"] * 2}
    _expect(lambda: pol.load_optimizer_state(opt, two),
            "the optimizer state holds 2 optimizers, this optimizer chains 1")
    ps.destroy_model_parallel()


def test_optimizer_states_that_do_not_fit_are_clear_errors():
    run_single(_state_errors_worker)


def _scaler_resume_worker(rank, world):
    """fp16 weights, the distributed optimizer (DP=1): its shard with a loss scale of 2^5 (as
    after overflows lowered it from 2^10) loaded into a fresh optimizer: the scale it starts
    from."""
    from megatron.core import parallel_state as ps

    from hacpo.models.megatron.policy import chained

    def policy():
        pol = W._policy_dtype(1, torch.float16)
        return pol, pol.build_optimizer(lr=0.05, optimizer="adam",
                                        use_distributed_optimizer=True,
                                        initial_loss_scale=2.0 ** 10)

    pol, opt = policy()
    before = float(opt.get_loss_scale())
    state = W._through_file(pol.optimizer_state(opt))
    ps.destroy_model_parallel()
    scaler = state["distributed"][0]["grad_scaler"]
    scaler["scale"] = scaler["scale"] / 32
    pol, opt = policy()
    pol.load_optimizer_state(opt, state)
    got = float(opt.get_loss_scale()), [float(o.grad_scaler.scale) for o in chained(opt)]
    ps.destroy_model_parallel()
    return before, *got


def test_distributed_optimizer_state_restores_the_fp16_loss_scale():
    before, loaded, per_opt = run_single(_scaler_resume_worker)
    assert before == 2.0 ** 10
    assert loaded == 2.0 ** 5 and per_opt == [2.0 ** 5]


def test_slices_of_another_length_than_their_range_are_an_error():
    """A slice whose moment holds more elements than its range (a shard from another DP
    layout, mislabelled) would otherwise join into a tensor of another parameter's layout."""
    from hacpo.models.megatron.policy import join_slices

    def piece(a, b, n=None):
        return {"step": torch.tensor(1.0), "exp_avg": torch.zeros(b - a if n is None else n),
                "exp_avg_sq": torch.ones(b - a), "range": (a, b), "shape": (2, 3)}

    assert join_slices([{"w": piece(0, 3)}, {"w": piece(3, 6)}])["w"]["exp_avg"].shape == (2, 3)
    with pytest.raises(ValueError, match=r"^the optimizer slices of 'w' \(exp_avg\) do not have "
                                         r"their ranges' lengths$"):
        join_slices([{"w": piece(0, 3, n=4)}, {"w": piece(3, 6, n=2)}])


def dp_weights_worker(rank, world, out_path):
    """TP=1, PP=1, DP=world: what ``hf_state_dict(everywhere=False)`` and
    ``hf_state_of_units`` return on each rank; rank 0 saves {rank: (whole weights or None, one
    unit's weights or None)} and the HF weights."""
    import torch.distributed as dist

    from hacpo.models.megatron import hf_state_dict, hf_units

    hf, pol = W._policy(("llama", True), 1, 1)
    got = (pol.hf_state_dict(everywhere=False), pol.hf_state_of_units(hf_units(pol.arch)[:1]))
    every = [None] * world
    dist.all_gather_object(every, got)
    if rank == 0:
        torch.save({"ranks": every, "ref": hf_state_dict(hf)}, out_path)


@pytest.mark.multiprocess
def test_other_dp_replicas_get_no_weights(tmp_path):
    """The trainer's weight pull (``everywhere=False``) and weight stream (``hf_state_of_units``)
    hand the weights to global rank 0 only: a DP replica other than 0 would otherwise build
    a full HF copy of its own, memory the pull is there to avoid."""
    path = tmp_path / "dp2.pt"
    spawn(dp_weights_worker, 2, str(path))
    res = torch.load(path)
    (whole, unit), other = res["ranks"]
    assert other == (None, None)
    assert whole.keys() == res["ref"].keys() and all(
        torch.equal(whole[k], v) for k, v in res["ref"].items())
    assert unit and set(unit) < set(whole)


def _fake_policy(tp: int, sequence_parallel: bool):
    """The attributes ``padded_length`` and ``token_logprobs`` read, around a stand-in for the
    schedule that records the micro-batches and scores every position 0."""
    from hacpo.models.megatron.policy import MegatronPolicy

    runs = []

    def run(mbs, **kw):
        runs.append(mbs)
        return [{"logprobs": torch.zeros(mb["positions"].shape)} for mb in mbs]

    fake = SimpleNamespace(par=SimpleNamespace(tp=tp, last_stage=True),
                           sequence_parallel=sequence_parallel,
                           model=SimpleNamespace(eval=lambda: None), _run=run,
                           _from_last_stage=lambda t, shape: t, runs=runs)
    fake.padded_length = lambda n: MegatronPolicy.padded_length(fake, n)
    return fake


def test_rows_are_padded_to_a_multiple_of_tp_only_under_sequence_parallelism():
    assert [_fake_policy(2, False).padded_length(n) for n in (1, 7, 8)] == [1, 7, 8]
    assert [_fake_policy(2, True).padded_length(n) for n in (1, 7, 8)] == [2, 8, 8]


def test_token_budget_counts_the_sequence_parallel_padding():
    """Under sequence parallelism forward() pads each micro-batch to a multiple of tp, so the
    token budget packs rows by those padded lengths: no forward runs over more tokens than
    the budget. The rows of W.score_positions run up to 8, 6, 1 and 7 positions (8, 6, 2, 8
    padded): packed into [row 0] [row 3] [rows 1, 2], not [rows 3, 1] (2 x 8 = 16 padded)."""
    from hacpo.models.megatron.policy import MegatronPolicy

    fake = _fake_policy(2, True)
    ids, targets = W.batch(96)
    pos, mask = W.score_positions()
    MegatronPolicy.token_logprobs(fake, ids, targets, positions=pos, mask=mask,
                                  micro_batch_size=3, micro_batch_tokens=14)
    shapes = [tuple(mb["input_ids"].shape) for mb in fake.runs[0]]
    assert shapes == [(1, 8), (1, 7), (2, 6)]
    assert all(b * fake.padded_length(s) <= 14 for b, s in shapes)


def _padded_vocab_worker(rank, world):
    """``from_hf`` with megatron's vocabulary padding (V=96 -> 128 rows) and megatron's own
    output layer: (lm_head, embedding rows, log-probs, HF log-probs, gathered == HF)."""
    from hacpo.models.megatron import MegatronPolicy, hf_state_dict, init_parallel

    hf = W.tiny_hf("llama")
    pol = MegatronPolicy.from_hf(hf, init_parallel(1, 1), make_vocab_size_divisible_by=128,
                                 lm_head="logits")
    ids, targets = W.batch(96)
    ref, back = hf_state_dict(hf), pol.hf_state_dict()
    same = back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
    return (pol.lm_head, pol.module.embedding.word_embeddings.weight.shape[0],
            pol.token_logprobs(ids, targets), W.hf_logprobs(hf, ids, targets), same)


def test_from_hf_passes_the_vocabulary_padding_and_lm_head_on():
    """The padded rows (32 here) are built, loaded and kept out of the softmax; the lm_head
    asked for is the one used."""
    lm_head, rows, lp, hf_lp, same = run_single(_padded_vocab_worker)
    assert lm_head == "logits" and rows == 128 and same
    # as test_megatron_policy.test_tp1_matches_hf (seen: ~5e-7); 32 padded columns in the
    # softmax would lower every log-prob by ~log(128/96) = 0.29
    torch.testing.assert_close(lp, hf_lp, atol=1e-5, rtol=0)


def test_micro_batches_in_row_order_are_cut_after_their_longest_row():
    """Without a token budget the micro-batches hold the rows in order: [rows 0, 1] [rows 2,
    3] of W.score_positions, up to 8, 6 | 1, 7 positions, are cut to 8 and 7 positions (a cut
    at the first row's 1 would leave row 3's scored positions out)."""
    from hacpo.models.megatron.policy import MegatronPolicy

    fake = _fake_policy(1, False)
    ids, targets = W.batch(96)
    pos, mask = W.score_positions()
    MegatronPolicy.token_logprobs(fake, ids, targets, positions=pos, mask=mask,
                                  micro_batch_size=2)
    assert [tuple(mb["input_ids"].shape) for mb in fake.runs[0]] == [(2, 8), (2, 7)]
    assert torch.equal(fake.runs[0][1]["targets"], targets[2:, :7])
