"""A user's own model folder (policy.kind=hf, policy.path), used as a user would (an exploratory
audit): damaged weight files are errors naming the file, and a loaded model's dropout stays
off for RL after sampling and the warm-up."""
import pytest
import torch

from hacpo.engine.rollout import LocalRolloutEngine
from hacpo.engine.warmup import supervised_warmup
from hacpo.models.hf import build_hf_model, load_hf_model
from hacpo.models.policy import PolicyConfig, build_policy


def _cut(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize("damage", ["cut safetensors", "empty safetensors", "cut shard",
                                    "cut bin", "empty bin"])
def test_damaged_weight_file_is_an_error_naming_it(tmp_path, damage):
    """A checkpoint copied in part (an interrupted download or scp) used to fail inside
    safetensors / torch.load with a message naming no file ("incomplete metadata, file not
    fully covered", "[Errno 22] Invalid argument", a bare EOFError), and for safetensors with
    an error type `hacpo train` printed as a traceback rather than one line."""
    from safetensors.torch import load_file

    model = build_hf_model({"arch": "llama", "hidden_size": 32, "intermediate_size": 64},
                           vocab_size=91)
    d = tmp_path / "m"
    model.save_pretrained(d, **({"max_shard_size": "40KB"} if "shard" in damage else {}))
    if "bin" in damage:          # an older checkpoint: pytorch_model.bin (torch.save)
        st = d / "model.safetensors"
        torch.save(load_file(st), d / "pytorch_model.bin")
        st.unlink()
    files = sorted(p.name for p in d.iterdir() if p.suffix in (".safetensors", ".bin"))
    bad = files[1] if "shard" in damage else files[0]
    assert len(files) > 2 if "shard" in damage else len(files) == 1
    assert torch.equal(load_hf_model(str(d)).lm_head.weight, model.lm_head.weight)  # whole
    _cut(d / bad, 0.0 if "empty" in damage else 0.5)
    with pytest.raises(ValueError, match=rf"HF checkpoint '{d}': weight file\(s\) \['{bad}'\] "
                                         rf"cannot be read"):
        build_policy(PolicyConfig(kind="hf", path=str(d)))


def test_missing_shard_keeps_transformers_message(tmp_path):
    """No damaged weight file: transformers' own error (it names the missing shard) is kept,
    and a Trainer output folder's training_args.bin (a pickle, no weights) is no weight file."""
    import argparse

    model = build_hf_model({"arch": "llama", "hidden_size": 32, "intermediate_size": 64},
                           vocab_size=91)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    torch.save(argparse.Namespace(learning_rate=1e-5), tmp_path / "training_args.bin")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_hf_model(str(tmp_path))


def test_loaded_models_dropout_stays_off_after_sampling_and_warmup(tmp_path):
    """A GPT-2 folder (GPT2Config's dropout is 0.1) loads in eval mode, but the policy wrapping
    it was a new Module in training mode: the rollout and evaluation, restoring
    ``policy.train(was)`` after sampling, and the warm-up's ``policy.train()`` turned the
    model's dropout on, so every RL log-prob (old and new) was random."""
    from transformers import AutoModelForCausalLM, GPT2Config

    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=91, n_embd=32, n_layer=2, n_head=4,
                                                n_positions=64)).save_pretrained(tmp_path)
    pol = build_policy(PolicyConfig(name="g", kind="hf", path=str(tmp_path)))
    assert pol.model.config.resid_pdrop == 0.1
    prompts, responses = [[1, 2, 3]] * 2, [[4, 5, 6, 7], [8, 9]]

    def deterministic():
        a, _ = pol.response_logprobs(prompts, responses)
        b, _ = pol.response_logprobs(prompts, responses)
        return not pol.model.training and torch.equal(a, b)

    assert deterministic()
    LocalRolloutEngine([pol], seed=0).generate(0, [[1, 2, 3]], num_samples=2, max_new_tokens=3,
                                               temperature=1.0, top_p=1.0)
    assert deterministic()
    supervised_warmup(pol, prompts, responses, steps=1, lr=1e-3, batch_size=2, seed=0)
    assert deterministic()


def test_weight_of_another_shape_than_config_json_names_the_keys(tmp_path):
    """config.json edited (vocab_size 91 -> 100) next to the old weights: transformers 5 raised
    a RuntimeError telling the user they had "set `ignore_mismatched_sizes` to `False`" (no
    such hacpo setting) and to look at a report in its log; the mismatched keys are named."""
    import json

    build_hf_model({"arch": "llama", "hidden_size": 32, "intermediate_size": 64,
                    "tie_word_embeddings": False}, vocab_size=91).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"does not hold all of LlamaForCausalLM's weights.*"
                                         r"mismatched keys: \['lm_head.weight \(checkpoint "
                                         r"\[91, 32\], config \[100, 32\]\)', "
                                         r"'model.embed_tokens.weight \(checkpoint"):
        build_policy(PolicyConfig(kind="hf", path=str(tmp_path)))
