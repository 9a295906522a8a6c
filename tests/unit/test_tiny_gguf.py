"""The project's tiny GGUF generator (tests/support/tiny_gguf.py): what it writes reads back."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from support.tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf


def test_writes_a_llama_gguf_with_vocab_template_and_pooling(tmp_path: Path) -> None:
    info = write_tiny_gguf(tmp_path / "t.gguf", n_layers=3)
    reader = gguf.GGUFReader(info.path)
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("tokenizer.chat_template").contents() == CHAT_TEMPLATE
    assert len(reader.get_field("tokenizer.ggml.tokens").contents()) == info.n_vocab
    assert reader.get_field("llama.block_count").contents() == 3
    assert reader.get_field("llama.pooling_type").contents() == int(gguf.PoolingType.MEAN)
    assert len(reader.tensors) == 3 + 9 * 3


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=1).path.read_bytes()
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=1).path.read_bytes()
    c = write_tiny_gguf(tmp_path / "c.gguf", seed=2).path.read_bytes()
    assert a == b
    assert a != c and len(a) == len(c)


def test_no_pooling_key_when_asked(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf", pooling=None).path)
    assert reader.get_field("llama.pooling_type") is None


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"n_embd": 30, "n_heads": 4}, "n_embd"), ({"n_layers": 0}, "n_layers"), ({"pooling": "max"}, "pooling")],
    ids=["embd-not-multiple-of-heads", "no-layers", "unknown-pooling"],
)
def test_impossible_dimensions_are_refused(tmp_path: Path, kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        write_tiny_gguf(tmp_path / "t.gguf", **kwargs)  # type: ignore[arg-type]
