"""A user's own GGUF file through ``python -m hacpo.models.gguf`` (an exploratory audit): what
the converter cannot expand or map is refused by name, never a traceback or dropped."""
import pytest

from hacpo.models.gguf import GGUFConversionError, main, read_llama_gguf
from tests.engine.test_rewards_gguf_mutants import _write_gguf


def test_tensor_type_the_gguf_package_cannot_dequantize_is_named(tmp_path, monkeypatch,
                                                                 capsys):
    """gguf.dequantize raises a bare NotImplementedError for some stored types (F64, I32,
    Q8_K...): the CLI printed its traceback, naming neither the tensor nor the file."""
    import gguf
    import numpy as np

    add = gguf.GGUFWriter.add_tensor

    def f64_up(self, name, t, **kw):
        return add(self, name, t.astype(np.float64) if name == "blk.0.ffn_up.weight" else t,
                   **kw)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", f64_up)
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    monkeypatch.undo()
    with pytest.raises(GGUFConversionError, match=rf"{path}: tensor 'blk.0.ffn_up.weight' is "
                                                  rf"stored as F64, which the gguf package "
                                                  rf"cannot dequantize"):
        read_llama_gguf(str(path))
    assert main([str(tmp_path / "out"), "--gguf", str(path)]) == 2
    assert "'blk.0.ffn_up.weight' is stored as F64" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]   # no output, no temp


@pytest.mark.parametrize("key, factor, refused", [("llama.rope.scale_linear", 4.0, True),
                                                  ("llama.rope.scaling.factor", 4.0, True),
                                                  ("llama.rope.scaling.factor", 1.0, False)])
def test_rope_scaling_factor_without_a_type_is_refused(tmp_path, monkeypatch, key, factor,
                                                       refused):
    """llama.cpp scales rotary positions linearly by ``rope.scaling.factor`` (or its old name
    ``rope.scale_linear``) when the file names no scaling type; the converter took "no type"
    as no scaling and wrote a model with other positions, silently. A factor of 1 scales
    nothing."""
    import gguf

    vocab = gguf.GGUFWriter.add_vocab_size

    def with_factor(self, n):
        vocab(self, n)
        self.add_float32(key, factor)
    monkeypatch.setattr(gguf.GGUFWriter, "add_vocab_size", with_factor)
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    monkeypatch.undo()
    if refused:
        with pytest.raises(GGUFConversionError, match=rf"rope scaling \['{key}'\] is not "
                                                      rf"handled"):
            read_llama_gguf(str(path))
    else:
        assert read_llama_gguf(str(path))[0]["rope_theta"] == 10000.0


@pytest.mark.parametrize("writer_method, key", [
    ("add_layer_norm_rms_eps", "llama.attention.layer_norm_rms_epsilon"),
    ("add_feed_forward_length", "llama.feed_forward_length"),
    ("add_embedding_length", "llama.embedding_length")])
def test_missing_metadata_key_is_named(tmp_path, monkeypatch, writer_method, key):
    """A file without a size key failed in int(None) (a TypeError traceback naming no key);
    one without the RMS-norm epsilon was converted with rms_norm_eps=nan (np.float32(None)),
    a model whose every output is NaN."""
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, writer_method, lambda self, *a: None)
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    monkeypatch.undo()
    with pytest.raises(GGUFConversionError, match=rf"{path}: metadata key '{key}' is missing"):
        read_llama_gguf(str(path))
