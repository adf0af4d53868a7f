"""The megatron trainer's bookkeeping that its end-to-end tests (test_megatron_trainer.py) never
reach, each checked without Ray against values worked out by hand:

- ``_pack``: the rows, the shifted targets and the positions that predict each response token;
- ``MegatronAgents._update_result``: the per-sample results of every DP replica's reporting
  rank merged, the ratio logs read at the samples' pool indices, the non-finite updates counted
  (streak, total, skipped) and the run stopped at ``max_nonfinite`` in a row, the padded tokens
  and micro-batches of the reporting ranks only (one per DP replica);
- ``MegatronRank.update`` (a 1-rank gloo world in a spawned process, as
  test_megatron_rank_update.py): the ranks' own streak of non-finite minibatches resets on a
  finite one and stops them at ``max_nonfinite`` in a row.
"""
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -c requirements/constraints.txt megatron-core==0.16.1)")

from hacpo.engine.config import AlgorithmConfig, LossConfig  # noqa: E402
from hacpo.engine.pool import LearnerView  # noqa: E402
from hacpo.engine.update import NonFiniteUpdateError  # noqa: E402
from hacpo.launch.megatron_trainer import MegatronAgents, _pack  # noqa: E402


def test_pack_rows_targets_and_response_positions():
    """Row i is prompt + response right-padded to S; targets are the row shifted left by one
    (targets[t] is the token after position t); pos[i, k] is the position whose next token is
    response token k, i.e. len(prompt) - 1 + k; rows past the samples (and columns past a
    response) are zero / unmasked."""
    prompts, resps = [[5, 6, 7], [9]], [[8, 4], [3, 2, 1]]
    ids, targets, pos, mask = _pack(prompts, resps, 3, 6)
    assert ids.tolist() == [[5, 6, 7, 8, 4, 0], [9, 3, 2, 1, 0, 0], [0] * 6]
    assert targets.tolist() == [[6, 7, 8, 4, 0, 0], [3, 2, 1, 0, 0, 0], [0] * 6]
    assert pos.tolist() == [[2, 3, 0], [0, 1, 2], [0, 0, 0]]
    assert mask.tolist() == [[True, True, False], [True, True, True], [False] * 3]
    for i, r in enumerate(resps):       # the scored targets are exactly the response tokens
        assert targets[i, pos[i, :len(r)]].tolist() == r


# _update_result: a learner view of 4 samples at pool indices 5, 2, 7, 0 (self, cross, self,
# cross) and two minibatches [0, 1], [2, 3], trained by a DP=2 group whose DP rank 0 reported
# samples 0 and 2, DP rank 1 samples 1 and 3; a third rank (TP rank 1 of DP rank 0) reports no
# samples
LP_OLD = torch.tensor([-1.0, 0.0, -2.0, 0.0, 0.0, -1.5, 0.0, -0.5])
NEW_LP = {0: -1.25, 1: -13.0, 2: -0.25, 3: -0.75}


def _agents(max_nonfinite=3, max_abs_log_ratio=10.0):
    agents = object.__new__(MegatronAgents)
    algo = AlgorithmConfig(name="hacpo", num_minibatches=2,
                           loss=LossConfig(max_abs_log_ratio=max_abs_log_ratio))
    agents.cfg = SimpleNamespace(algorithm=algo, max_nonfinite=max_nonfinite)
    agents.names, agents.kl = ["a"], False
    return agents


def _view():
    return LearnerView(idx=torch.tensor([5, 2, 7, 0]), advantages=torch.tensor([1., -1., .5, 2.]),
                       omega=torch.ones(4), is_self=torch.tensor([True, False, True, False]),
                       prompt_ids=[[1, 2]] * 4, response_ids=[[3, 4], [3], [5, 6, 7], [4]],
                       dropped={})


def _results(finite, losses):
    def rank(dp_rank, reporter, rows, padded, micro):
        return {"minibatches": [
            {"finite": f, "loss": loss, "grad_norm": 0.5,
             "new_lp": {j: torch.tensor(NEW_LP[j]) for j in rows if j in mb} if reporter else {},
             "tl": {}, "kl": {}}
            for f, loss, mb in zip(finite, losses, ([0, 1], [2, 3], [0, 1]))],
            "times": {"optimizer": 0.25 + dp_rank}, "micro_batches": micro,
            "padded_tokens": padded, "dp_rank": dp_rank, "reporter": reporter, "span": (0, 1)}
    return [rank(0, True, [0, 2], 10, 2), rank(0, False, [], 1000, 50),
            rank(1, True, [1, 3], 6, 3)]


@pytest.mark.parametrize("bound", [10.0, 5.0])
def test_update_result_merges_the_dp_replicas_samples_and_logs_ratios_by_pool_index(bound):
    """The logged log-ratios are new - old at the samples' pool indices, clamped to the loss's
    ``max_abs_log_ratio`` (SPEC's +-10 by default) as update_learner logs them."""
    view, pool = _view(), SimpleNamespace(lp_old=LP_OLD, old_token_logp=[])
    nonfinite, ratio_log, sw = {"streak": 2, "total": 2}, {}, {}
    out = _agents(max_abs_log_ratio=bound)._update_result(0, view, pool, [[0, 1], [2, 3]],
                                   _results([True, True], [0.5, 1.5]), nonfinite, ratio_log, sw)
    assert [t.tolist() for t in ratio_log["self"]] == [[-1.25 + 1.5], [-0.25 + 0.5]]
    assert [t.tolist() for t in ratio_log["cross"]] == [[-bound], [-0.75 + 1.0]]   # -11
    # every sample of both DP replicas counted; the applied updates' losses averaged
    assert out["self_count"] == 2 and out["cross_count"] == 2
    assert out["loss"] == pytest.approx(1.0)
    want = (math.exp(-1.25 + 1.5) + math.exp(-0.25 + 0.5)) / 2
    assert out["self_ratio_mean"] == pytest.approx(want, rel=1e-6)
    assert (out["trained_samples"], out["trained_self"], out["trained_cross"]) == (4, 2, 2)
    # what the two replicas' forwards ran on (their reporting ranks), not the TP peer's
    assert out["tokens_update_padded"] == 16 and out["update_micro_batches"] == 5
    # none skipped: no such key (as update_learner); an applied update resets the streak
    assert "skipped_updates" not in out and nonfinite == {"streak": 0, "total": 2}
    assert sw == {"time/optimizer/a": 0.25}      # the reporting rank of DP rank 0


def test_update_result_with_a_sample_lost_is_an_error():
    """DP rank 1's reporter returns no log-prob for view row 3 of minibatch 1: the update's
    metrics are an error naming the lost row, not means over the samples that came back."""
    view, pool = _view(), SimpleNamespace(lp_old=LP_OLD, old_token_logp=[])
    results = _results([True, True], [0.5, 1.5])
    del results[2]["minibatches"][1]["new_lp"][3]
    with pytest.raises(RuntimeError, match=r"minibatch 1: no new log-prob for 1 of its 2 "
                                           r"samples \(view rows \[3\]\)"):
        _agents()._update_result(0, view, pool, [[0, 1], [2, 3]], results,
                                 {"streak": 0, "total": 0}, None, {})


def test_update_result_counts_nonfinite_updates():
    """A skipped (non-finite) update adds to the streak and the total; an applied one resets
    the streak; only applied updates enter the loss."""
    view, pool = _view(), SimpleNamespace(lp_old=LP_OLD, old_token_logp=[])
    nonfinite = {"streak": 1, "total": 4}
    out = _agents(max_nonfinite=3)._update_result(
        0, view, pool, [[0, 1], [2, 3], [0, 1]],
        _results([False, True, False], [float("nan"), 2.0, float("inf")]), nonfinite, None, {})
    assert nonfinite == {"streak": 1, "total": 6, "agents": {"a": 1}}
    assert out["skipped_updates"] == 2 and out["loss"] == 2.0


@pytest.mark.parametrize("streak, finite, raised_at", [(0, [False, False, True], 2),
                                                       (2, [False, True], 3)])
def test_update_result_stops_at_max_nonfinite_in_a_row(streak, finite, raised_at):
    view, pool = _view(), SimpleNamespace(lp_old=LP_OLD, old_token_logp=[])
    nonfinite = {"streak": streak, "total": streak}
    with pytest.raises(NonFiniteUpdateError, match=rf"{raised_at} non-finite updates in a row "
                                                   rf"for policy 'a'.*max_nonfinite=\d"):
        _agents(max_nonfinite=raised_at)._update_result(
            0, view, pool, [[0, 1], [2, 3], [0, 1]][:len(finite)],
            _results(finite, [float("nan")] * len(finite)), nonfinite, None, {})
    assert nonfinite["streak"] == raised_at


# the rank's own streak: minibatches of 2 rows; the old log-probs of the rows of minibatches
# 0, 2 and 3 are NaN (a NaN ratio: a non-finite loss and gradient)
NAN_MINIBATCHES = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
NAN_ROWS = [0, 1, 4, 5, 6, 7]


def _streak_worker(rank, port, out):
    from tests.launch.test_megatron_rank_update import ALGO, _inputs, _policy, one_rank
    from tests.megatron._cpu_megatron import cpu_patches

    torch.set_num_threads(1)
    with cpu_patches():
        pol = _policy()
        view, lp_old, _ = _inputs(pol)
        lp_old[NAN_ROWS] = float("nan")
        r = one_rank(port, pol, torch.float32)
        got = {}
        for streak, max_nonfinite in ((0, 2), (0, 3), (1, 2)):
            res = r.update({"algo": ALGO, "view": view, "lp_old": lp_old, "kl_coef": 0.0,
                            "ref_token_logp": {}, "old_token_logp": [],
                            "minibatches": NAN_MINIBATCHES, "micro_batch": 2,
                            "micro_batch_tokens": 0, "temperature": 1.0, "streak": streak,
                            "max_nonfinite": max_nonfinite})
            got[streak, max_nonfinite] = [m["finite"] for m in res["minibatches"]]
        torch.save(got, out)
        r.close()


@pytest.mark.multiprocess
def test_rank_stops_at_max_nonfinite_minibatches_in_a_row(tmp_path):
    from tests.megatron._cpu_megatron import free_port

    out = str(tmp_path / "streak.pt")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    mp.spawn(_streak_worker, args=(free_port(), out), nprocs=1, join=True)
    got = torch.load(out)
    # max 2: minibatch 1 (finite) resets the streak, minibatches 2 and 3 make 2 in a row: stop
    assert got[0, 2] == [False, True, False, False]
    # max 3: never 3 in a row: all five run
    assert got[0, 3] == [False, True, False, False, True]
    # entering with a streak of 1 (earlier non-finite updates of the step): stop at once
    assert got[1, 2] == [False]



@pytest.mark.parametrize("parallel_mb, rollout_mb", [(1024.0, 1e-6), (1e-6, 1024.0)])
def test_published_buckets_hold_at_most_the_smaller_bucket_size(parallel_mb, rollout_mb):
    """publish_weights asks rank 0 for buckets of at most the smaller of
    ``parallel.weight_bucket_mb`` and ``rollout.weight_bucket_mb`` (an engine holds one at a
    time): with either one below every unit's size, each weight unit (embedding, each layer,
    final norm + output layer) is a bucket of its own. Stand-in ranks: rank 0 answers with the
    names and shapes of the driver policy's tensors of the units asked for."""
    from hacpo.models.megatron import hf_units, unit_of_hf_name
    from hacpo.models.megatron.build import ArchSpec
    from hacpo.models.policy import PolicyConfig, build_policy

    pol = build_policy(PolicyConfig(name="a", kind="hf", arch="llama", tokenizer="char",
                                    hf_config={"hidden_size": 32, "intermediate_size": 64,
                                               "num_hidden_layers": 2, "num_attention_heads": 4,
                                               "num_key_value_heads": 2}, seed=0))
    sd = pol.model.state_dict()
    sd.pop("lm_head.weight")                    # tied: the embedding (in no bucket)
    asked = []

    def put(units):
        units = [tuple(u) for u in units]
        asked.append(units)
        return [f"ref-{len(asked) - 1}", {n: tuple(t.shape) for n, t in sd.items()
                                          if unit_of_hf_name(n) in units}]

    agents = object.__new__(MegatronAgents)
    agents.policies, agents.names = [pol], ["a"]
    agents.cfg = SimpleNamespace(rollout=SimpleNamespace(weight_bucket_mb=rollout_mb))
    ranks = [SimpleNamespace(hf_weights_put=SimpleNamespace(remote=put)),
             SimpleNamespace(hf_weights_put=SimpleNamespace(remote=lambda units: None))]
    agents._groups = [SimpleNamespace(torch=False, ranks=ranks,
                                      par=SimpleNamespace(weight_bucket_mb=parallel_mb))]
    agents.weight_buckets, agents._published = [0], [None]
    agents._gather = lambda k, refs: refs
    units = hf_units(ArchSpec.from_hf(pol.model.config))
    assert len(units) == 4                      # embedding, 2 layers, final norm
    assert agents.publish_weights(0) == [f"ref-{i}" for i in range(4)]
    assert asked == [[u] for u in units] and agents.weight_buckets == [4]
