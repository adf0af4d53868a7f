"""megatron-core GPTModel policies on CPU/gloo: weights load strictly and gather back exactly,
vocab-parallel log-probs match the HF model and are invariant to TP and PP, and a DP=2
optimizer step equals the single-process full-batch step.

The CUDA calls megatron-core makes are patched in ``_cpu_megatron`` (test helper only).
Pipeline parallelism runs megatron-core's own 1F1B schedule (``get_forward_backward_func``),
not a hand-written send/recv.
"""
import logging
import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from tests.megatron import _workers as W  # noqa: E402
from tests.megatron._cpu_megatron import run_single, spawn  # noqa: E402

CASES = [("llama", True), ("qwen2", False), ("qwen3", True)]


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    """TP=1 PP=1 results (single process): {case: (megatron lp, gathered==orig, HF lp)}."""
    path = tmp_path_factory.mktemp("tp1") / "tp1.pt"
    run_single(W.logprobs_worker, 1, 1, str(path), CASES)
    return torch.load(path)


def test_tp1_matches_hf(tp1):
    for case, (lp, same, hf_lp) in tp1.items():
        assert same, f"{case}: weights gathered back from megatron differ from the HF ones"
        # The weights are scaled so that log-probs spread (std ~1 nat): a mapping error moves
        # them by O(0.1). fp32 with a different op order (fused QKV GEMM, baddbmm attention,
        # megatron RoPE) rounds to ~1e-6 (seen: 5e-7), so 1e-5 is tight but not flaky.
        assert hf_lp.std() > 0.5, "test model too close to uniform for the tolerance to bite"
        torch.testing.assert_close(lp, hf_lp, atol=1e-5, rtol=0, msg=str(case))


def test_init_parallel_errors_and_impl_log(caplog):
    from hacpo.models.megatron import build_gpt_model, init_parallel
    from hacpo.models.megatron.build import ArchSpec

    def body(rank, world):
        with pytest.raises(ValueError, match=r"tp\*pp\*dp = 2\*1\*1 = 2 does not match the "
                                             r"world size 1"):
            init_parallel(2, 1, 1)
        par = init_parallel(1, 1)
        arch = ArchSpec.from_hf(W.tiny_hf("llama").config)
        with caplog.at_level(logging.INFO, logger="hacpo.models.megatron.build"):
            build_gpt_model(arch, par)
        assert "transformer_impl=local" in caplog.text

    run_single(body)


@pytest.mark.multiprocess
def test_tp2_logprobs_and_weights(tp1, tmp_path):
    path = tmp_path / "tp2.pt"
    spawn(W.logprobs_worker, 2, 2, 1, str(path), CASES)
    for case, (lp, same, _) in torch.load(path).items():
        assert same, f"{case}: TP-gathered weights differ from the HF ones"
        # vocab-parallel log-softmax and row-parallel all-reduces only reorder fp32 sums
        # (seen: 1e-6); 1e-5 is the requirement.
        torch.testing.assert_close(lp, tp1[case][0], atol=1e-5, rtol=0, msg=str(case))


@pytest.mark.multiprocess
def test_pp2_logprobs_and_weights(tp1, tmp_path):
    path = tmp_path / "pp2.pt"
    spawn(W.logprobs_worker, 2, 1, 2, str(path), CASES[:2])
    for case, (lp, same, _) in torch.load(path).items():
        assert same, f"{case}: PP-gathered weights differ from the HF ones"
        # PP sends fp32 activations between stages: the math is unchanged (seen: identical).
        torch.testing.assert_close(lp, tp1[case][0], atol=1e-6, rtol=0, msg=str(case))


@pytest.mark.multiprocess
def test_dp2_step_equals_full_batch_step(tmp_path):
    """megatron DDP + get_megatron_optimizer (plain FP32Optimizer; the distributed one:
    test_distributed_optimizer_equals_plain_and_resumes). SGD exposes any gradient
    scaling error (update = lr * grad); Adam checks the adaptive path."""
    opts = ("sgd", "adam")
    single, dp2 = tmp_path / "single.pt", tmp_path / "dp2.pt"
    run_single(W.train_worker, "qwen2", W.B // 2, opts, str(single))  # 2 micro-batches, 1 rank
    spawn(W.train_worker, 2, "qwen2", W.B // 2, opts, str(dp2))       # 1 micro-batch per rank
    a, b = torch.load(single), torch.load(dp2)
    for name in opts:
        before, after_1 = a[name]
        before_2, after_2 = b[name]
        biggest = 0.0
        for k in after_1:
            assert torch.equal(before[k], before_2[k])
            d1, d2 = after_1[k] - before[k], after_2[k] - before[k]
            biggest = max(biggest, d1.abs().max().item())
            # same gradient summed in another order (seen: 6e-8 on updates of ~0.1)
            torch.testing.assert_close(d2, d1, atol=1e-6, rtol=0, msg=f"{name} {k}")
        assert biggest > 1e-2, f"{name}: the step did not change the weights"


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,world,dtype", [(1, 2, torch.float32), (2, 4, torch.float32),
                                            (1, 2, torch.bfloat16)],
                         ids=["dp2", "tp2-dp2", "dp2-bf16"])
def test_distributed_optimizer_equals_plain_and_resumes(tmp_path, tp, world, dtype):
    """megatron's distributed optimizer (ZeRO-1, ``use_distributed_optimizer=True``): two Adam
    steps give the plain optimizer's weights; each DP rank holds the Adam moments of its slice
    only (the ranks' slices add up to the plain optimizer's state, each about 1/dp of it); a
    rank's ``optimizer_state`` after step 1, loaded into a fresh policy and optimizer with the
    step-1 weights, gives the same step 2 (what a checkpoint resume does); a plain state or a
    slice of another shape is a clear error. With bf16 weights the state holds the slices' fp32
    main weights (without them the resumed step is off by bf16 rounding: 4e-3 seen)."""
    path = tmp_path / "zero1.pt"
    spawn(W.distributed_optimizer_worker, world, tp, str(path), dtype)
    res = torch.load(path)
    dp = world // tp
    before, plain, dist_ = res["before"], res["plain"], res["dist"]
    for step in range(2):
        moved = max((plain[step][k] - before[k]).abs().max().item() for k in before)
        assert moved > 1e-2, f"step {step + 1} did not move the weights"
        for k in before:
            # gradients reduce-scattered instead of all-reduced (seen: identical)
            torch.testing.assert_close(dist_[step][k], plain[step][k], atol=1e-6, rtol=0,
                                       msg=f"step {step + 1} {k}")
    assert any(not torch.equal(plain[1][k], plain[0][k]) for k in before)
    assert res["resumed"]["model.embed_tokens.weight"].dtype == dtype
    for k in before:
        torch.testing.assert_close(res["resumed"][k], dist_[1][k], atol=1e-6, rtol=0, msg=k)
        # the plain optimizer's state likewise (with bf16 weights: megatron's fp32 norm
        # weights come back from it, not from the rounded HF copy)
        torch.testing.assert_close(res["resumed_plain"][k], plain[1][k], atol=1e-6, rtol=0,
                                   msg=k)
    numel = res["numel"]
    for tp_rank in range(tp):
        full = {n for t, _, n in numel["plain"] if t == tp_rank}
        assert len(full) == 1, numel["plain"]           # every DP rank: the whole state
        full = full.pop()
        slices = [n for t, _, n in numel["dist"] if t == tp_rank]
        assert len(slices) == dp and sum(slices) == full, (slices, full)
        assert max(slices) <= 0.6 * full, (slices, full)
    assert res["errors"][0] == ("the optimizer state was written without megatron's "
                                "distributed optimizer, which this optimizer is")
    assert res["errors"][1].startswith("the optimizer state's parameter slices ") and \
        res["errors"][1].endswith("written with another layout"), res["errors"][1]


def _moved(res: dict, arch, path, distributed: bool = False) -> float:
    """The step-1 optimizer shards of a :func:`W.reshard_worker` run read by name
    (``named_moments``) and gathered to HF names (``moments_of_layout``, the trainer's: the
    distributed optimizer's DP slices joined) and written to ``path`` with the step-1 weights
    for another layout's workers, as a resume in another layout does. Returns the step."""
    from hacpo.models.megatron.policy import grad_scaler_states, moments_of_layout, named_moments

    pp = 1 + max(pp_rank for (pp_rank, _, _), _ in res["shards"])
    tp = 1 + max(tp_rank for (_, tp_rank, _), _ in res["shards"])
    for _, state in res["shards"]:
        assert len(state["params"]) == 1 and all(
            e["name"] for g in state["params"][0] for e in g)
    step, hf = moments_of_layout([((tp_rank, pp_rank, dp_rank), named_moments(state))
                                  for (pp_rank, tp_rank, dp_rank), state in res["shards"]],
                                 tp, pp, sliced=distributed, arch=arch)
    assert step == 1.0 and hf["exp_avg"].keys() == res["w1"].keys()
    assert max(v.abs().max().item() for v in hf["exp_avg_sq"].values()) > 0
    torch.save({"w1": res["w1"], "step": step, "hf": hf,
                "scalers": grad_scaler_states(res["shards"][0][1])}, path)
    return step


def _step1_moved_weights(res: dict) -> float:
    return max((res["w2"][k] - res["w1"][k]).abs().max().item() for k in res["w1"])


@pytest.mark.multiprocess
def test_optimizer_state_moves_to_another_layout(tmp_path):
    """Adam's state written by the ranks of one layout (TP=2, every rank's
    ``optimizer_state`` with its parameter names) read by name (``named_moments``), gathered to
    HF names (``moments_to_hf``: the moments move as the weights do) and cut for another layout
    (TP=1 x PP=2, DP=2, and DP=2 with the distributed optimizer, each DP rank taking its slice)
    continues the run: step 2 there equals step 2 in the first layout. What a resume with
    another tp / pp / dp does."""
    from hacpo.models.megatron import ArchSpec

    a = tmp_path / "a.pt"
    spawn(W.reshard_worker, 2, 2, 1, None, str(a))
    res = torch.load(a)
    arch = ArchSpec.from_hf(W.case_model(("llama", True)).config)
    moved = tmp_path / "moved.pt"
    _moved(res, arch, moved)
    assert _step1_moved_weights(res) > 1e-2                  # step 2 moved the weights
    for tp, pp, world, distributed in ((1, 2, 2, False), (1, 1, 2, False), (1, 1, 2, True)):
        b = tmp_path / f"b-{tp}-{pp}-{world}-{distributed}.pt"
        spawn(W.reshard_worker, world, tp, pp, str(moved), str(b), distributed)
        got = torch.load(b)
        assert got["set"] > 0
        for k in res["w2"]:
            # the same update from the same state in another layout: TP=1's gradients differ
            # from TP=2's by rounding (~1e-7), which Adam at lr 0.05 carries into the weights
            # (seen: <= 3.4e-6); a step from a fresh state differs by ~1e-2
            torch.testing.assert_close(got["w2"][k], res["w2"][k], atol=2e-5, rtol=0,
                                       msg=f"tp{tp} pp{pp} dp{world // (tp * pp)} "
                                           f"distributed={distributed} {k}")


@pytest.mark.multiprocess
def test_distributed_and_bf16_state_moves_to_another_layout(tmp_path):
    """The distributed optimizer's state (each DP rank's slices, joined by ``join_slices``)
    and bf16 weights' state (Adam's moments plus the fp32 main weights, the only
    full-precision copy) move to another layout like the plain fp32 state: the distributed
    optimizer's TP=2 x DP=2 slices continue at PP=2 with the plain optimizer (step 2 equal to
    the first layout's within rounding); bf16 at DP=2 with the distributed optimizer continues
    with the plain optimizer at DP=1 (megatron's Float16Optimizer) and with the distributed
    one at DP=3 (slices cut anew, of unequal sizes): the fp32 main weights after step 2 equal
    the first layout's (without the moved main weights they would be off by bf16 rounding,
    ~1e-3), and the bf16 weights are theirs rounded. fp16 likewise (plain at DP=1 to the
    distributed optimizer at DP=2), with the dynamic loss scaler's state."""
    from hacpo.models.megatron import ArchSpec, hf_to_megatron
    from hacpo.models.megatron.policy import grad_scaler_states

    arch = ArchSpec.from_hf(W.case_model(("llama", True)).config)
    a = tmp_path / "a.pt"
    spawn(W.reshard_worker, 4, 2, 1, None, str(a), True)
    res = torch.load(a)
    # each rank holds slices: ranges within its parameters, not whole ones
    entries = [e for _, st in res["shards"] for g in st["params"][0] for e in g]
    assert all(e["range"] is not None for e in entries)
    assert any(e["range"][1] - e["range"][0] < math.prod(e["shape"]) for e in entries)
    moved = tmp_path / "moved.pt"
    _moved(res, arch, moved, distributed=True)
    assert _step1_moved_weights(res) > 1e-2
    b = tmp_path / "b.pt"
    spawn(W.reshard_worker, 2, 1, 2, str(moved), str(b))
    got = torch.load(b)
    assert got["set"] > 0
    for k in res["w2"]:
        torch.testing.assert_close(got["w2"][k], res["w2"][k], atol=2e-5, rtol=0, msg=k)

    a = tmp_path / "a16.pt"
    spawn(W.reshard_worker, 2, 1, 1, None, str(a), True, torch.bfloat16)
    res = torch.load(a)
    assert res["w1"]["model.embed_tokens.weight"].dtype == torch.bfloat16
    # megatron steps the bf16 weights through fp32 main copies, its fp32 norm weights directly
    mains = [e["main"] for _, st in res["shards"] for g in st["params"][0] for e in g]
    assert any(mains) and not all(mains)
    _moved(res, arch, moved, distributed=True)
    main1 = torch.load(moved)["hf"]["main"]
    # the main weights are not the bf16 weights: they hold what bf16 rounds away
    assert max((main1[k] - res["w1"][k].float()).abs().max().item() for k in main1) > 1e-4
    for world, distributed in ((1, False), (3, True)):
        b = tmp_path / f"b16-{world}-{distributed}.pt"
        spawn(W.reshard_worker, world, 1, 1, str(moved), str(b), distributed, torch.bfloat16)
        got = torch.load(b)
        assert got["set"] > 0 and got["main2"].keys() == res["main2"].keys()
        for k in res["main2"]:
            # the same fp32 update; gradients summed in another order (rounding ~1e-7 of them)
            torch.testing.assert_close(got["main2"][k], res["main2"][k], atol=1e-6, rtol=0,
                                       msg=f"dp{world} distributed={distributed} {k}")
        # the bf16 weights are the main weights rounded, the fp32 ones the main weights
        w2 = hf_to_megatron(got["w2"], arch)
        assert w2.keys() == got["main2"].keys()
        assert {w.dtype for w in w2.values()} == {torch.bfloat16, torch.float32}
        for k, w in w2.items():
            assert torch.equal(w, got["main2"][k].to(w.dtype)), k

    a = tmp_path / "a-fp16.pt"
    spawn(W.reshard_worker, 1, 1, 1, None, str(a), False, torch.float16)
    res = torch.load(a)
    # step 2 is a real Adam step (lr 0.05): the moves below compare something (gradients
    # 1/2^32 of their value, as before the loss was scaled, fell below Adam's eps)
    assert _step1_moved_weights(res) > 1e-2
    _moved(res, arch, moved)
    b = tmp_path / "b-fp16.pt"
    spawn(W.reshard_worker, 2, 1, 1, str(moved), str(b), True, torch.float16)
    got = torch.load(b)
    # the loss scaler's state after step 1 (a fresh one has counted no step: tracker 0)
    assert got["scalers"][0]["growth_tracker"] == 1
    assert got["scalers"] == grad_scaler_states(res["shards"][0][1])
    for k in res["main2"]:
        torch.testing.assert_close(got["main2"][k], res["main2"][k], atol=1e-6, rtol=0, msg=k)


def test_bad_scoring_requests_are_clear_errors(tmp_path):
    """positions without a mask (or the reverse), positions past the sequence, a micro-batch
    size of -1, logprobs_at with positions alone or on an output of another length: each a
    ValueError saying what is wrong."""
    path = tmp_path / "bad.pt"
    run_single(W.bad_positions_worker, str(path))
    msgs = torch.load(path)
    assert msgs[0] == msgs[1] == msgs[4] == "pass positions and mask together"
    assert msgs[2] == f"positions must lie in [0, {W.S}), got {2 * W.S - 1}"
    assert msgs[3] == "micro_batch_size must be >= 1, got -1"
    assert msgs[5] == (f"the model output ({W.S + 1}, {W.B}, 64) does not cover the {W.S} "
                       f"positions of targets ({W.B}, {W.S})")


def test_state_of_an_optimizer_with_the_step_per_group_moves(tmp_path):
    """megatron-core builds TE's or apex's FusedAdam when either is installed (GPU machines):
    the step is then per parameter group, not per parameter. A stand-in with that layout
    (``W.GroupStepAdam``, the same AdamW update) takes the same steps as torch's AdamW, and
    Adam's state moves by name between the two kinds (a resume in another layout): step 2
    after the move equals step 2 without one, and the group optimizer gets its step in its
    groups (a fresh step count would redo Adam's bias correction: a step off by ~lr)."""
    path = tmp_path / "group_step.pt"
    run_single(W.group_step_adam_worker, str(path))
    res = torch.load(path)
    steps, keys = res["group_state"]           # megatron's groups (with / without decay)
    assert steps and set(steps) == {1} and keys == ["exp_avg", "exp_avg_sq"]
    assert max((res["torch"][k] - res["w1/torch"][k]).abs().max().item()
               for k in res["torch"]) > 1e-2                  # step 2 moved the weights
    for kind in ("group", "group->torch", "torch->group"):
        for k in res["torch"]:
            # the same AdamW math in another op order: rounding only (seen: <= 2e-7)
            torch.testing.assert_close(res[kind][k], res["torch"][k], atol=1e-5, rtol=0,
                                       msg=f"{kind} {k}")


def test_other_pipeline_stages_get_the_last_stage_tensor_on_the_parameters_device(monkeypatch):
    """At PP > 1 the stages before the last receive the log-probs by a broadcast into a buffer
    of their own, which must be on the parameters' device (NCCL broadcasts CUDA tensors only;
    on this CPU machine the device is shown with "meta" parameters)."""
    from types import SimpleNamespace

    from hacpo.models.megatron import policy as mp

    seen = []
    monkeypatch.setattr(mp.dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(mp.dist, "broadcast", lambda t, src, group: seen.append((t, src)))
    fake = SimpleNamespace(par=SimpleNamespace(pp=2, pp_group=object()),
                           module=torch.nn.Linear(2, 2, device="meta"))
    out = mp.MegatronPolicy._from_last_stage(fake, None, (3, 5))
    assert out.device.type == "meta" and out.shape == (3, 5) and out.dtype == torch.float32
    assert seen == [(out, 1)]


def test_local_state_holds_weights_only():
    """transformer-engine layers add ``_extra_state`` entries (an empty CPU tensor without fp8)
    to the state dict: no weights, and a TP all-gather of them over NCCL fails; ``local_state``
    (what ``hf_state_dict`` gathers and the reference shards save) leaves them out."""
    from types import SimpleNamespace

    from hacpo.models.megatron.policy import MegatronPolicy

    w = torch.ones(2, 2)
    state = {"decoder.layers.0.mlp.linear_fc1.weight": w,
             "decoder.layers.0.mlp.linear_fc1._extra_state": torch.empty(0, dtype=torch.uint8),
             "decoder.layers.0.self_attention.core_attention._extra_state": None}
    fake = SimpleNamespace(module=SimpleNamespace(state_dict=lambda: state))
    got = MegatronPolicy.local_state(fake)
    assert list(got) == ["decoder.layers.0.mlp.linear_fc1.weight"] and got[
        "decoder.layers.0.mlp.linear_fc1.weight"] is not w and torch.equal(got[
            "decoder.layers.0.mlp.linear_fc1.weight"], w)
