"""How the Ray rollout pool splits an agent's prompts over its actors and puts the shards'
rollouts back together (pure functions, no Ray): expected values written out by hand, since
the pool's own tests compare against a reference built with these same functions."""
from hacpo.launch.ray_rollout import merge_rollouts, shard_bounds
from hacpo.models.generation import Rollout


def test_shard_bounds_are_contiguous_near_equal_first_ones_longer():
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert shard_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]          # never an empty shard
    assert shard_bounds(7, 1) == [(0, 7)]


def _part(prompts, G, tag):
    """A shard's rollout: response of sample g of prompt p is [tag, p[0], g]."""
    n = len(prompts) * G
    return Rollout(policy_name="x", prompt_ids=prompts,
                   prompt_index=[i for i in range(len(prompts)) for _ in range(G)],
                   response_ids=[[tag, p[0], g] for p in prompts for g in range(G)],
                   sampler_logprobs=[[-float(tag)] * 3] * n,
                   finished_eos=[tag == 1] * n, truncated=[tag != 1] * n)


def test_merge_rollouts_keeps_each_sample_with_its_prompt():
    a, b, c = [[10], [11], [12]], [[13], [14]], [[15]]
    ro = merge_rollouts([_part(a, 2, 1), _part(b, 2, 2), _part(c, 2, 3)], "agent")
    assert ro.policy_name == "agent"
    assert ro.prompt_ids == [[10], [11], [12], [13], [14], [15]]
    assert ro.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert ro.response_ids == [[1, 10, 0], [1, 10, 1], [1, 11, 0], [1, 11, 1], [1, 12, 0],
                               [1, 12, 1], [2, 13, 0], [2, 13, 1], [2, 14, 0], [2, 14, 1],
                               [3, 15, 0], [3, 15, 1]]
    # every sample's response names the prompt its prompt_index points at
    assert all(r[1] == ro.prompt_ids[i][0] for r, i in zip(ro.response_ids, ro.prompt_index))
    assert ro.sampler_logprobs == [[-1.0] * 3] * 6 + [[-2.0] * 3] * 4 + [[-3.0] * 3] * 2
    assert ro.finished_eos == [True] * 6 + [False] * 6
    assert ro.truncated == [False] * 6 + [True] * 6
