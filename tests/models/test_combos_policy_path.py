"""An HF model loaded from ``policy.path`` combined with ``policy.reduce_vocab``: the reduced
tokenizer renumbers the data's tokens as ids 0..V-1, which index the saved model's embedding
rows of *other* tokens unless the model was saved for that reduced vocabulary."""
import pytest
import torch

from hacpo.models.hf import build_hf_model
from hacpo.models.policy import PolicyConfig, build_policy
from hacpo.models.tokenizer import load_tokenizer

CORPUS = ["Tom has 3 apples. He gets 4 more. How many apples?", "#### 7"]
HF = {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}


def _save(path, vocab_size: int, tok) -> str:
    build_hf_model(HF, vocab_size=vocab_size, pad_id=tok.pad_id, eos_id=tok.eos_id,
                   dtype=torch.float32, seed=0).save_pretrained(path)
    return str(path)


def test_full_vocabulary_model_with_reduce_vocab_is_refused(tmp_path):
    """Used to build and train silently: reduced id i read the embedding of the model's token
    i (a pretrained model would see other text than the prompt)."""
    full = load_tokenizer("gpt2")
    path = _save(tmp_path / "full", full.vocab_size, full)
    cfg = PolicyConfig(name="p", kind="hf", tokenizer="gpt2", reduce_vocab=True, path=path)
    with pytest.raises(ValueError, match=rf"policy 'p': policy\.reduce_vocab=True .* "
                                         rf"{full.vocab_size} rows.*reduce_vocab=false"):
        build_policy(cfg, corpus=CORPUS)
    # the same model with its own vocabulary builds, and so does the reduced vocabulary with a
    # model saved for it (e.g. exported from a reduced-vocabulary run)
    assert build_policy(PolicyConfig(kind="hf", tokenizer="gpt2", path=path)) is not None
    reduced = load_tokenizer("gpt2", corpus=CORPUS)
    own = _save(tmp_path / "reduced", reduced.vocab_size, reduced)
    pol = build_policy(PolicyConfig(kind="hf", tokenizer="gpt2", reduce_vocab=True, path=own),
                       corpus=CORPUS)
    assert pol.output_weight.shape[0] == pol.tokenizer.vocab_size == reduced.vocab_size
    # an already reduced tokenizer passed in is checked the same way
    with pytest.raises(ValueError, match=r"reduce_vocab=True .* rows"):
        build_policy(PolicyConfig(kind="hf", path=path), tokenizer=reduced)
