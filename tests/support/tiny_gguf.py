"""The project's generator of a tiny random llama-architecture GGUF for fast engine tests.

Nothing upstream is read: the vocabulary (byte-level, SentencePiece style), the chat
template and the weights are all generated here with gguf-py and numpy. The model talks
gibberish, fast (over a thousand tokens per second on one CPU core), and llama-server serves
every endpoint with it: chat (streamed and not), completions, Anthropic's messages, Responses,
tokenize, embeddings with ``--embedding``, and rerank with ``--reranking`` (a ``qwen3``
file with ``pooling="rank"``).

    from support.tiny_gguf import write_tiny_gguf
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

__all__ = ["TinyGGUF", "write_tiny_gguf", "CHAT_TEMPLATE", "WORD_PIECES"]

# A ChatML-like template; llama-server renders it with its own Jinja engine.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# SentencePiece writes a leading space as U+2581.
_SPACE = "\u2581"
WORD_PIECES: tuple[str, ...] = ("the", "and", "hello", "world", "model", "token", "tiny", "test")

_UNK, _BOS, _EOS = 0, 1, 2


@dataclass(frozen=True, slots=True)
class TinyGGUF:
    """What was written: the file and its dimensions (for assertions on /props, /slots)."""

    path: Path
    n_vocab: int
    n_embd: int
    n_layers: int
    n_ctx_train: int


def _vocab() -> tuple[list[bytes], list[float], list[int]]:
    """<unk> <s> </s>, 256 byte tokens, then single letters and a few words.

    Only printable ASCII byte tokens (and tab, newline) are typed BYTE. The others stay in
    the vocab so byte fallback can still tokenize any prompt, but are typed UNUSED so a
    random model never samples invalid UTF-8 (llama-server's chat parser answers 500 on it).
    """
    kinds = gguf.TokenType
    tokens: list[bytes] = []
    scores: list[float] = []
    types: list[int] = []

    def add(text: str, score: float, kind: int) -> None:
        tokens.append(text.encode("utf-8"))
        scores.append(score)
        types.append(int(kind))

    add("<unk>", 0.0, kinds.UNKNOWN)
    add("<s>", 0.0, kinds.CONTROL)
    add("</s>", 0.0, kinds.CONTROL)
    for b in range(256):
        printable = 0x20 <= b < 0x7F or b in (0x09, 0x0A)
        add(f"<0x{b:02X}>", 0.0, kinds.BYTE if printable else kinds.UNUSED)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [_SPACE, *letters, *(_SPACE + c for c in letters)]
    for word in WORD_PIECES:
        pieces += [word, _SPACE + word]
    for rank, piece in enumerate(pieces, start=1):
        add(piece, -float(rank), kinds.NORMAL)
    return tokens, scores, types


def write_tiny_gguf(
    path: str | Path,
    seed: int = 0,
    *,
    n_embd: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    name: str = "tiny-random-llama",
    pooling: str | None = "mean",
    arch: str = "llama",
) -> TinyGGUF:
    """Write a random llama GGUF (all tensors F32) to ``path`` and describe it.

    ``seed`` fixes the weights, so the same arguments give the same bytes. ``n_embd`` must
    be a multiple of ``n_heads``. ``n_ctx_train`` is the trained context llama-server takes
    when given no ``--ctx-size``. ``pooling`` ("mean", "cls", "last" or None) is what
``--embedding`` pools with: llama-server refuses OpenAI embeddings for a model whose pooling
is "none", which is what a llama GGUF without the key gets; chat ignores it. About 0.5 MB
with the defaults. ``pooling="rank"`` makes a reranker for ``--reranking``: the file also gets
the one-output classification head (``cls.output.weight``) rank pooling scores with. llama-server
loads that head for ``arch="qwen3"`` (Qwen3's per-head query/key norms are added) and refuses it
on "llama" ("wrong number of tensors"), so a reranker is ``arch="qwen3", pooling="rank"``.

    Raises ValueError on impossible dimensions.
    """
    if n_embd < 1 or n_heads < 1 or n_embd % n_heads:
        raise ValueError(f"n_embd ({n_embd}) must be a positive multiple of n_heads ({n_heads})")
    if n_layers < 1 or n_ff < 1 or n_ctx_train < 1:
        raise ValueError(
            f"n_layers ({n_layers}), n_ff ({n_ff}) and n_ctx_train ({n_ctx_train}) must be >= 1"
        )
    pooling_types = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "last": gguf.PoolingType.LAST,
                     "rank": gguf.PoolingType.RANK}
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"arch must be 'llama' or 'qwen3', got {arch!r}")
    if pooling is not None and pooling not in pooling_types:
        raise ValueError(f"pooling must be one of {sorted(pooling_types)} or None, got {pooling!r}")
    out = Path(path)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_heads)
    writer.add_rope_dimension_count(n_embd // n_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if pooling is not None:
        writer.add_pooling_type(pooling_types[pooling])

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(_BOS)
    writer.add_eos_token_id(_EOS)
    writer.add_unk_token_id(_UNK)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def tensor(tensor_name: str, *shape: int, ones: bool = False) -> None:
        # numpy shapes are ggml's ne[] reversed; gguf-py writes them the right way round.
        if ones:
            data = np.ones(shape, np.float32)
        else:
            data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        writer.add_tensor(tensor_name, data)

    tensor("token_embd.weight", n_vocab, n_embd)
    tensor("output_norm.weight", n_embd, ones=True)
    tensor("output.weight", n_vocab, n_embd)
    for i in range(n_layers):
        tensor(f"blk.{i}.attn_norm.weight", n_embd, ones=True)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{proj}.weight", n_embd, n_embd)
        if arch == "qwen3":  # Qwen3 normalises queries and keys per head
            tensor(f"blk.{i}.attn_q_norm.weight", n_embd // n_heads, ones=True)
            tensor(f"blk.{i}.attn_k_norm.weight", n_embd // n_heads, ones=True)
        tensor(f"blk.{i}.ffn_norm.weight", n_embd, ones=True)
        tensor(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)

    if pooling == "rank":  # the classification head a reranker scores with: one output
        tensor("cls.output.weight", 1, n_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path=out, n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers, n_ctx_train=n_ctx_train)


if __name__ == "__main__":  # pragma: no cover - a convenience for capturing by hand
    import argparse

    parser = argparse.ArgumentParser(description="write a tiny random llama GGUF")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    info = write_tiny_gguf(ns.out, ns.seed)
    print(f"wrote {info.path}: vocab={info.n_vocab} embd={info.n_embd} layers={info.n_layers}")
