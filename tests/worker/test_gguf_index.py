"""The GGUF tensor directory (``worker/gguf_index.py``) against files the ``gguf`` package writes:
metadata of every kind stepped over, names, types, shapes, and offsets that find each tensor's
bytes, with the default and a custom alignment."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from strata.worker.gguf_index import read_index


def write_file(path: Path, alignment: int | None) -> dict[str, np.ndarray]:
    """A small llama-architecture file with string, array and scalar metadata, one Q8_0 matrix
    and one float32 vector; returns the bytes written for each tensor."""
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "hello", "wörld"] * 50)
    writer.add_token_scores([0.5] * 150)
    writer.add_float32("test.scale", 1.5)
    writer.add_bool("test.flag", True)
    writer.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    matrix = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    vector = rng.standard_normal(64).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", matrix, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", vector)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"blk.0.attn_q.weight": matrix.reshape(-1).view(np.uint8), "blk.0.attn_norm.weight": vector.view(np.uint8)}


@pytest.mark.parametrize("alignment", [None, 64], ids=["default-alignment", "custom-alignment"])
def test_the_directory_finds_every_tensor_past_all_metadata(alignment: int | None, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    written = write_file(path, alignment)
    index = read_index(path)
    assert index.architecture == "llama"
    assert set(index.tensors) == set(written)
    matrix, vector = index.tensors["blk.0.attn_q.weight"], index.tensors["blk.0.attn_norm.weight"]
    assert (matrix.type, matrix.shape) == (int(gguf.GGMLQuantizationType.Q8_0), (64, 8))
    assert (vector.type, vector.shape) == (int(gguf.GGMLQuantizationType.F32), (64,))
    data = np.fromfile(path, dtype=np.uint8)
    for name, expected in written.items():
        offset = index.tensors[name].offset
        assert offset % (alignment or 32) == 0
        assert np.array_equal(data[offset : offset + expected.size], expected), name


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_index(path)
