"""Tests that kill mutants which survived the reward / task / warm-up / GGUF test suites (a
mutation audit): each assert pins a documented behaviour no other fast test checked.

The GGUF tests write a tiny llama GGUF with the ``gguf`` package's writer (no download), so the
converter's reading (names, config, rotary un-permutation, dequantization, refusals) is checked
without the SmolLM2 wheel."""
import math
import warnings

import pytest
import torch

from hacpo.engine.rewards import (RewardComputer, extract_answer, extract_boxed, get_reward_fn,
                                  gold_answer, math_fast_path, math_reward, parse_number,
                                  register_reward)
from hacpo.engine.tasks import ArithmeticTask
from hacpo.engine.warmup import supervised_warmup

BOX = "\\boxed{%s}"


# ---- answer extraction ----------------------------------------------------------------------

def test_unbalanced_last_box_falls_back_to_an_earlier_closed_box():
    # The last box never closes: the earlier, closed box is the answer (not the last number).
    assert extract_answer("\\boxed{x+1} then \\boxed{") == "x+1"


def test_boxed_without_brace_token_drops_its_period():
    assert extract_boxed("so \\boxed 5.") == "5"


def test_minus_after_a_closing_brace_is_subtraction():
    assert extract_answer("Then \\sqrt{9}-1") == "1"


def test_short_token_after_gsm8k_marker_is_the_answer():
    # Up to 3 characters without a space is an answer, not a markdown heading.
    assert extract_answer("I checked it.\n#### yes") == "yes"


def test_nested_answer_is_is_read_to_the_innermost_one():
    # Three "answer" markers: the innermost fragment gives its leading number (5), not its
    # last one (3).
    text = "Answer: The answer is: the final answer is 5 apples and 3 pears."
    assert extract_answer(text) == "5"


@pytest.mark.parametrize("text", ["The answer is 42!", "The answer is 42!\nDone.",
                                  "The answer is 42?"])
def test_exclamation_ending_an_answer_line_is_punctuation(text):
    # "!" at the end of the line ends the sentence as it does before a space (it was read as
    # 42 factorial: reward 0 for a right answer).
    assert extract_answer(text) == "42"
    assert math_reward(text, "42") == 1.0


def test_boxed_gold_is_reduced_and_decided_by_the_fast_path():
    assert gold_answer("\\boxed{5}") == "5"
    assert math_fast_path("#### 5", "\\boxed{5}") == 1.0
    assert get_reward_fn("exact")("#### 5", "\\boxed{5}") == 1.0


# ---- number parsing -------------------------------------------------------------------------

def test_mixed_number_needs_a_proper_fraction():
    assert parse_number("2 4/4") is None      # numerator == denominator: not a mixed number
    assert parse_number("2 3/4") == parse_number("11/4")


@pytest.mark.parametrize("text", ["1/0", "\\frac{1}{0}", "-\\frac{3}{0}"])
def test_zero_denominator_is_not_a_number_and_scores_zero(text):
    assert parse_number(text) is None
    assert math_fast_path(BOX % text, "1") is None or math_fast_path(BOX % text, "1") == 0.0
    assert get_reward_fn("numeric_closeness")(BOX % text, "1") == 0.0


def test_latex_dollar_before_a_leading_decimal_point():
    assert parse_number("\\$.5") == parse_number("0.5")


def test_fast_path_decides_numbers_farther_apart_than_the_rounding_band():
    # 1/3 and 0.33334 differ by 6.7e-6 > 1e-6: math-verify (6 decimals) never equates them, so
    # the fast path decides (only pairs within 1e-6 go to math-verify).
    assert math_fast_path(BOX % "0.33334", "\\frac{1}{3}") == 0.0


# ---- the math / exact rewards ---------------------------------------------------------------

def test_math_reward_falls_back_to_string_match_when_math_verify_cannot_parse():
    # math-verify parses neither side of "\\" or "\\text{}" (parse gives []): normalized
    # string equality decides.
    assert math_reward("#### \\", "\\") == 1.0
    assert math_reward(BOX % "\\text{}", "\\text{}") == 1.0
    assert math_reward("#### \\", "\\text{}") == 0.0


def test_exact_reward_uses_the_whole_response_without_a_final_answer():
    assert get_reward_fn("exact")("Paris", "paris") == 1.0


# ---- the registry and the batch scorer ------------------------------------------------------

@register_reward("mutaudit_str", in_process=True)
def _str_reward(response: str, gold: str):
    return "0.5"


def test_reward_returning_a_string_is_an_error():
    with RewardComputer("mutaudit_str", num_workers=0) as rc:
        with pytest.raises(ValueError, match="item 0: not a number"):
            rc.score(["x"], ["y"])


def test_unknown_reward_error_lists_the_registered_names():
    with pytest.raises(KeyError, match=r"registered: \[.*'exact'.*'math'"):
        get_reward_fn("no-such-reward")


def test_overwrite_replaces_a_registered_reward():
    register_reward("mutaudit_over", in_process=True)(lambda r, g: 0.0)
    new = register_reward("mutaudit_over", in_process=True, overwrite=True)(lambda r, g: 1.0)
    assert get_reward_fn("mutaudit_over") is new


def test_score_rejects_mismatched_lengths():
    with RewardComputer("exact", num_workers=0) as rc:
        with pytest.raises(ValueError, match="2 responses but 1 gold answers"):
            rc.score(["a", "b"], ["a"])


# ---- the arithmetic task --------------------------------------------------------------------

def test_multipliers_are_at_most_five_and_start_values_at_least_two():
    import re
    task = ArithmeticTask.from_difficulty("hard", seed=0)
    exs = task.train_split(300)
    mults = [int(m) for ex in exs for m in re.findall(r"has (\d+) times as many", ex.prompt)]
    assert mults and max(mults) <= 5
    starts = [int(re.match(r"\w+ has (\d+) ", ex.prompt).group(1)) for ex in exs]
    assert min(starts) >= 2


def test_no_step_is_zero():
    import re
    # Without allow_negative, a value at 0 is never followed by "gives away 0".
    for level in ("easy", "medium"):
        for ex in ArithmeticTask.from_difficulty(level, seed=0).train_split(500):
            assert "gives away 0" not in ex.prompt, ex.prompt
            assert all(int(n) >= 1 for n in re.findall(r"\d+", ex.prompt.split(".", 1)[1]))


@pytest.mark.parametrize("kwargs", [dict(num_steps=(0, 2)), dict(max_operand=0),
                                    dict(wording="words")])
def test_more_invalid_settings(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)


def test_negative_count_and_impossible_split_are_errors():
    with pytest.raises(ValueError, match="n must be >= 0"):
        ArithmeticTask().train_split(-1)
    # One possible problem ("1 + 1"): it falls on one side of the split; the other side cannot
    # be drawn and says so instead of returning fewer problems.
    task = ArithmeticTask(num_steps=(1, 1), max_operand=1, ops="+")
    results = []
    for split in (task.train_split, task.heldout_split):
        try:
            results.append(len(split(1)))
        except RuntimeError as e:
            assert "cannot draw 1" in str(e)
            results.append("error")
    assert sorted(map(str, results)) == ["1", "error"]


# ---- supervised warm-up ---------------------------------------------------------------------

class _Unigram(torch.nn.Module):
    """A stand-in policy: every target token's log-prob is log_softmax(logits)[token],
    independent of the prompt; records what each call saw."""
    name = "unigram"

    def __init__(self, vocab: int = 8, dead: bool = False, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.logits = torch.nn.Parameter(torch.zeros(vocab))
        self.dead = torch.nn.Parameter(torch.ones(3)) if dead else None  # zero gradient
        self.calls = []

    def response_logprobs(self, prompts, targets):
        self.calls.append(dict(prompts=[list(p) for p in prompts], training=self.training,
                               grads_clear=all(p.grad is None or not p.grad.any()
                                               for p in self.parameters())))
        T = max(map(len, targets))
        mask = torch.tensor([[j < len(t) for j in range(T)] for t in targets])
        idx = torch.tensor([[t[j] if j < len(t) else 0 for j in range(T)] for t in targets])
        tl = self.scale * torch.log_softmax(self.logits, -1)[idx]
        if self.dead is not None:
            tl = tl + 0.0 * self.dead.sum()
        return tl, mask


def test_warmup_zero_steps_does_nothing():
    pol = _Unigram()
    assert supervised_warmup(pol, [[1]], [[2]], steps=0, lr=1e-2, batch_size=2, seed=0) == []
    assert not pol.calls and (pol.logits == 0).all()


def test_warmup_rejects_mismatched_prompts_and_targets():
    with pytest.raises(ValueError, match="as many targets as prompts"):
        supervised_warmup(_Unigram(), [[1], [2]], [[3]], steps=1, lr=1e-2, batch_size=2, seed=0)


def test_warmup_loss_is_the_token_mean_nll_over_the_whole_batch():
    # Uniform logits: every token's NLL is log(8), so the token mean is log(8) whatever the
    # batch (targets of 1 and 3 tokens, duplicates in a batch of 8 from 2 pairs) and however
    # it is split into micro-batches.
    pol = _Unigram()
    calls = []
    losses = supervised_warmup(pol, [[0], [1]], [[2], [3, 4, 5]], steps=1, lr=1e-2,
                               batch_size=8, seed=0, micro_batch=3,
                               progress=lambda s, l: calls.append((s, l)))
    assert losses[0] == pytest.approx(math.log(8), rel=1e-6)
    assert calls == [(0, losses[0])]


def test_warmup_clips_gradients_to_norm_one():
    # One step: the gradient left on the parameter is the clipped one. Its raw value is
    # 10 * (softmax - onehot) at uniform logits, of norm 10 * sqrt(7/8) ~ 9.35.
    pol = _Unigram(scale=10.0)
    supervised_warmup(pol, [[0]], [[1]], steps=1, lr=1e-2, batch_size=4, seed=0)
    assert float(torch.linalg.vector_norm(pol.logits.grad)) <= 1.0 + 1e-5


def test_warmup_each_step_starts_from_zero_gradients_in_train_mode():
    pol = _Unigram()
    pol.eval()
    supervised_warmup(pol, [[0]], [[1, 2]], steps=3, lr=1e-2, batch_size=2, seed=0)
    assert [c["grads_clear"] for c in pol.calls] == [True] * 3
    assert all(c["training"] for c in pol.calls)


def test_warmup_has_no_weight_decay():
    pol = _Unigram(dead=True)
    supervised_warmup(pol, [[0]], [[1]], steps=3, lr=0.1, batch_size=2, seed=0)
    assert (pol.dead.detach() == 1).all()


def test_warmup_batches_follow_the_seed():
    prompts, targets = [[i] for i in range(6)], [[1]] * 6

    def seen(seed):
        pol = _Unigram()
        supervised_warmup(pol, prompts, targets, steps=3, lr=1e-2, batch_size=4, seed=seed)
        return [c["prompts"] for c in pol.calls]

    assert seen(1) == seen(1)
    assert seen(0) != seen(1)


def test_warmup_learning_rate_warms_up_then_decays():
    # A constant-sign gradient: each Adam step moves the logit by ~lr * schedule(step).
    hist = []

    class _Recording(_Unigram):
        def response_logprobs(self, prompts, targets):
            hist.append(float(self.logits.detach()[1]))
            return super().response_logprobs(prompts, targets)

    pol = _Recording()
    supervised_warmup(pol, [[0]], [[1]], steps=20, lr=1e-2, batch_size=1, seed=0)
    hist.append(float(pol.logits.detach()[1]))
    moves = [b - a for a, b in zip(hist, hist[1:])]
    assert moves[0] < 0.75 * moves[2]            # warm-up: step 0 at half the peak rate
    assert moves[-1] < 0.5 * moves[2]            # decay towards 0.1 of it


# ---- GGUF reading (hacpo.models.gguf) on a tiny synthetic llama file ------------------------

def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (HF halves -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


_HIDDEN, _HEADS, _KV_HEADS, _FFN, _VOCAB = 16, 2, 1, 32, 10    # head_dim 8: 4 rotary pairs


def _hf_weights(hd=_HIDDEN // _HEADS):
    import numpy as np
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (_VOCAB, _HIDDEN), "model.norm.weight": (_HIDDEN,),
              "model.layers.0.input_layernorm.weight": (_HIDDEN,),
              "model.layers.0.post_attention_layernorm.weight": (_HIDDEN,),
              "model.layers.0.self_attn.q_proj.weight": (_HEADS * hd, _HIDDEN),
              "model.layers.0.self_attn.k_proj.weight": (_KV_HEADS * hd, _HIDDEN),
              "model.layers.0.self_attn.v_proj.weight": (_KV_HEADS * hd, _HIDDEN),
              "model.layers.0.self_attn.o_proj.weight": (_HIDDEN, _HEADS * hd),
              "model.layers.0.mlp.gate_proj.weight": (_FFN, _HIDDEN),
              "model.layers.0.mlp.up_proj.weight": (_FFN, _HIDDEN),
              "model.layers.0.mlp.down_proj.weight": (_HIDDEN, _FFN),
              "lm_head.weight": (_VOCAB, _HIDDEN)}
    out = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    # Q8_0-exact values (multiples of 1/8 up to 127/8 in each 32-block): d = 1/8 in float16
    row = np.concatenate([np.arange(-127, -111), np.arange(112, 128)]).astype(np.float32) / 8
    out["model.layers.0.mlp.down_proj.weight"] = np.tile(row, (_HIDDEN, 1))  # [16, 32]
    return out


def _write_gguf(path, *, arch="llama", tied=True, extra_fields=None, extra_tensor=None,
                q8_down=False, head_dim=None):
    """head_dim: written as llama.rope.dimension_count, the attention weights shaped for it
    (None: no such field, head_dim hidden / heads)."""
    import numpy as np
    import gguf
    hf = _hf_weights() if head_dim is None else _hf_weights(head_dim)
    gg = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
          "model.norm.weight", "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
          "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
          "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
          "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
          "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
          "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
          "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
          "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
          "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}
    if not tied:
        gg["output.weight"] = "lm_head.weight"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(_HIDDEN)
    w.add_feed_forward_length(_FFN)
    w.add_head_count(_HEADS)
    w.add_head_count_kv(_KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(_VOCAB)
    if head_dim is not None:
        w.add_rope_dimension_count(head_dim)
    for key, value in (extra_fields or {}).items():
        w.add_string(key, value)
    for name, hf_name in gg.items():
        t = hf[hf_name]
        if name == "blk.0.attn_q.weight":
            t = _llama_cpp_permute(t, _HEADS)
        elif name == "blk.0.attn_k.weight":
            t = _llama_cpp_permute(t, _KV_HEADS)
        if q8_down and name == "blk.0.ffn_down.weight":
            w.add_tensor(name, gguf.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    if extra_tensor is not None:
        w.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, set(gg.values())


def test_unpermute_rope_inverts_llama_cpp_permute():
    import numpy as np
    from hacpo.models.gguf import unpermute_rope
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 3):
        back = unpermute_rope(_llama_cpp_permute(w, heads), heads)
        assert np.array_equal(back, w)
        assert not np.array_equal(_llama_cpp_permute(w, heads), w)


@pytest.mark.parametrize("tied, head_dim", [(True, None), (False, None), (True, 4)])
def test_gguf_config_names_and_weights(tmp_path, tied, head_dim):
    """head_dim 4: a file whose heads are not hidden / heads wide (8) says so in
    rope.dimension_count, which the config takes."""
    import numpy as np
    from hacpo.models.gguf import read_llama_gguf
    hf, names = _write_gguf(tmp_path / "m.gguf", tied=tied, q8_down=True, head_dim=head_dim)
    with warnings.catch_warnings():
        # copies, not read-only views of the memory-mapped file (torch warns on those)
        warnings.filterwarnings("error", message=".*not writable")
        config, tensors = read_llama_gguf(str(tmp_path / "m.gguf"))
    assert config["rms_norm_eps"] == 1e-05 and repr(config["rms_norm_eps"]) == "1e-05"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["intermediate_size"], config["num_hidden_layers"],
            config["vocab_size"], config["rope_theta"]) == (
        _HIDDEN, _HEADS, _KV_HEADS, head_dim or _HIDDEN // _HEADS, _FFN, 1, _VOCAB, 10000.0)
    assert config["tie_word_embeddings"] is tied
    assert set(tensors) == names
    for name in names:
        assert tensors[name].dtype == torch.float32, name
        assert np.array_equal(tensors[name].numpy(), hf[name]), name   # Q8_0 values exact


@pytest.mark.parametrize("kind", ["arch", "tensor", "rope_scaling"])
def test_gguf_refuses_what_it_does_not_map(tmp_path, kind):
    from hacpo.models.gguf import GGUFConversionError, read_llama_gguf
    path = tmp_path / "m.gguf"
    if kind == "arch":
        # A non-llama file is refused by name even when its keys would otherwise fit.
        import gguf
        w = gguf.GGUFWriter(str(path), "gpt2")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        match = "only 'llama' is handled"
    elif kind == "tensor":
        _write_gguf(path, extra_tensor="blk.0.attn_q.bias")
        match = "'blk.0.attn_q.bias' has no transformers Llama name"
    else:
        _write_gguf(path, extra_fields={"llama.rope.scaling.type": "linear"})
        match = "rope scaling"
    with pytest.raises(GGUFConversionError, match=match):
        read_llama_gguf(str(path))
    if kind == "rope_scaling":       # "none" is no scaling: accepted
        _write_gguf(tmp_path / "n.gguf", extra_fields={"llama.rope.scaling.type": "none"})
        read_llama_gguf(str(tmp_path / "n.gguf"))


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_unreadable_gguf_is_a_conversion_error(tmp_path, damage, capsys):
    # The gguf package raises a bare ValueError for these; the converter names the file and
    # its CLI prints one line with exit status 2, leaving no output folder.
    from hacpo.models.gguf import GGUFConversionError, main, read_llama_gguf
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(b"XXXX" + data[4:] if damage == "magic" else data[:-20])
    with pytest.raises(GGUFConversionError, match="not a readable GGUF file"):
        read_llama_gguf(str(path))
    out = tmp_path / "out"
    assert main([str(out), "--gguf", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(path) in err and "not a readable GGUF" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]   # no output, no temp
