"""llama.cpp embedding backends: ``--pooling mean`` exactly when the GGUF declares no pooling.

GGUF files are written here with gguf-py's writer (``support.tiny_gguf`` for whole models,
``GGUFWriter`` directly for headers only); gguf-py's reader is the oracle for the adapter's
own header reader (``engines/llamacpp/gguf_metadata.py``).
"""

from __future__ import annotations

import os
import struct
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.tiny_gguf import write_tiny_gguf
from viiwork.engines.contract import BackendSpec, Kind
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions
from viiwork.engines.llamacpp.gguf_metadata import GGUFMetadataError, GGUFPooling, read_pooling

ENGINE = LlamaCppEngine()
MEAN = ("--pooling", "mean")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny llama GGUFs: without a pooling type, and with each one llama.cpp names."""
    root = tmp_path_factory.mktemp("pooling")
    out = {}
    for pooling in (None, "mean", "cls", "last"):
        name = pooling or "undeclared"
        out[name] = write_tiny_gguf(root / f"{name}.gguf", pooling=pooling).path
    return out


def header_only(path: Path, arch: str = "llama", *, endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
                extra: dict[str, object] | None = None, pooling: int | None = None) -> Path:
    """A GGUF with metadata and no tensors (enough for the header reader)."""
    writer = gguf.GGUFWriter(str(path), arch, endianess=endian)
    writer.add_name("header-only")
    writer.add_token_list([f"tok{i}".encode() for i in range(3000)])
    writer.add_token_scores([0.0] * 3000)
    writer.add_array("test.nested", [[1, 2], [3, 4, 5]])
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))  # type: ignore[arg-type]
    if pooling is not None:
        writer.add_uint32(f"{arch}.pooling_type", pooling)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def spec_for(path: Path | str, **overrides: object) -> BackendSpec:
    base = BackendSpec(
        model="embed", kind=Kind.EMBEDDING, path=str(path), port=8111, ctx_per_slot=512,
        parallel=1, options=LlamaCppOptions(), host_cpus=2,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def pooling_flags(argv: tuple[str, ...]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--pooling"]


# --- the command ----------------------------------------------------------------------------


def test_embedding_gguf_without_pooling_type_gets_pooling_mean(models: dict[str, Path]) -> None:
    argv = ENGINE.build_command(spec_for(models["undeclared"])).argv
    at = argv.index("--embedding")
    assert argv[at + 1:at + 3] == MEAN
    assert pooling_flags(argv) == ["mean"]


@pytest.mark.parametrize("declared", ["mean", "cls", "last"])
def test_declared_pooling_type_is_left_to_llama_server(models: dict[str, Path], declared: str) -> None:
    assert pooling_flags(ENGINE.build_command(spec_for(models[declared])).argv) == []


def test_declared_pooling_none_is_respected(tmp_path: Path) -> None:
    """An explicit pooling type, even none (0), is the file's choice, not an absence."""
    path = header_only(tmp_path / "none.gguf", pooling=int(gguf.PoolingType.NONE))
    assert read_pooling(path) == GGUFPooling("llama", 0)
    assert pooling_flags(ENGINE.build_command(spec_for(path)).argv) == []


def test_chat_backend_never_gets_pooling(models: dict[str, Path]) -> None:
    assert pooling_flags(ENGINE.build_command(spec_for(models["undeclared"], kind=Kind.CHAT)).argv) == []


@pytest.mark.parametrize("args", [("--pooling", "cls"), ("--pooling=last",), ("--ubatch-size", "512", "--pooling", "rank")])
def test_operator_pooling_args_win(models: dict[str, Path], args: tuple[str, ...]) -> None:
    argv = ENGINE.build_command(spec_for(models["undeclared"], args=args)).argv
    assert argv[-len(args):] == args
    assert MEAN not in [tuple(argv[i:i + 2]) for i in range(len(argv) - 1)]


def test_other_operator_args_still_get_pooling_mean_before_them(models: dict[str, Path]) -> None:
    args = ("--ubatch-size", "512")
    argv = ENGINE.build_command(spec_for(models["undeclared"], args=args)).argv
    assert argv[-2:] == args and pooling_flags(argv) == ["mean"]


def test_command_version_bumped_for_the_pooling_rule() -> None:
    # 2: the pooling rule; 3: the key file, CORS and the Unix socket (engines/llamacpp).
    assert LlamaCppEngine.command_version >= 2


def test_demo_smollm2_declares_no_pooling_type(smollm2_path: Path) -> None:
    """The issue's case: the demo's SmolLM2 GGUF, served as an embedding model."""
    assert read_pooling(smollm2_path) == GGUFPooling("llama", None)
    assert pooling_flags(ENGINE.build_command(spec_for(smollm2_path)).argv) == ["mean"]


# --- unreadable files: no flag, no crash ---------------------------------------------------


def _unreadable(tmp_path: Path, models: dict[str, Path]) -> dict[str, Path | str]:
    good = models["undeclared"].read_bytes()
    cases: dict[str, Path | str] = {}

    def write(name: str, data: bytes) -> None:
        cases[name] = tmp_path / name
        (tmp_path / name).write_bytes(data)

    cases["missing"] = tmp_path / "missing.gguf"
    cases["directory"] = tmp_path
    cases["nul in path"] = str(tmp_path / "a\x00b.gguf")
    write("empty", b"")
    write("short", good[:20])
    write("truncated in the vocabulary", good[:4000])
    write("not gguf", b"GGML" + good[4:])
    write("version 1", good[:4] + struct.pack("<I", 1) + good[8:])
    write("huge kv count", good[:16] + struct.pack("<Q", 1 << 62) + good[24:])
    write("garbage", os.urandom(4096))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases["fifo"] = fifo
    unreadable = tmp_path / "unreadable.gguf"
    unreadable.write_bytes(good)
    unreadable.chmod(0)
    cases["no permission"] = unreadable  # root still reads it: then it is simply readable
    return cases


def test_unreadable_files_get_no_flag_and_no_crash(tmp_path: Path, models: dict[str, Path]) -> None:
    for label, path in _unreadable(tmp_path, models).items():
        argv = ENGINE.build_command(spec_for(path)).argv
        expected = ["mean"] if label == "no permission" and os.geteuid() == 0 else []
        assert pooling_flags(argv) == expected, label


@pytest.mark.parametrize("label", ["short", "truncated in the vocabulary", "not gguf", "version 1", "huge kv count", "empty"])
def test_malformed_headers_raise_gguf_metadata_error(tmp_path: Path, models: dict[str, Path], label: str) -> None:
    with pytest.raises(GGUFMetadataError):
        read_pooling(_unreadable(tmp_path, models)[label])


# --- the header reader against gguf-py ------------------------------------------------------


def _oracle(path: Path) -> GGUFPooling:
    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture")
    arch_name = arch.contents() if arch is not None else ""
    field = reader.get_field(f"{arch_name}.pooling_type")
    return GGUFPooling(arch_name, None if field is None else int(field.contents()))


@pytest.mark.parametrize(
    ("arch", "pooling", "endian", "extra"),
    [
        ("llama", None, gguf.GGUFEndian.LITTLE, {}),
        ("llama", 1, gguf.GGUFEndian.LITTLE, {}),
        ("bert", 2, gguf.GGUFEndian.LITTLE, {}),
        ("bert", 3, gguf.GGUFEndian.BIG, {"test.text": "x" * 1000}),
        ("nomic-bert", None, gguf.GGUFEndian.BIG, {}),
        # Another architecture's key is not this model's pooling type.
        ("bert", None, gguf.GGUFEndian.LITTLE, {"llama.pooling_type": 1}),
    ],
    ids=["llama-none", "llama-mean", "bert-cls", "bert-last-big-endian", "nomic-none-big-endian", "other-arch-key"],
)
def test_header_reader_agrees_with_gguf_py(tmp_path: Path, arch: str, pooling: int | None,
                                          endian: gguf.GGUFEndian, extra: dict[str, object]) -> None:
    path = header_only(tmp_path / "h.gguf", arch, endian=endian, extra=extra, pooling=pooling)
    assert read_pooling(path) == _oracle(path) == GGUFPooling(arch, pooling)


def test_whole_models_agree_with_gguf_py(models: dict[str, Path]) -> None:
    for path in models.values():
        assert read_pooling(path) == _oracle(path)


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    """A header-only GGUF's bytes, and a folder to write damaged copies in."""
    root = tmp_path_factory.mktemp("fuzz")
    return header_only(root / "base.gguf", pooling=1).read_bytes(), root


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_damage_is_a_gguf_metadata_error_or_an_answer(fuzz_base: tuple[bytes, Path], data: st.DataObject) -> None:
    """Truncations and overwritten bytes anywhere in the header: only GGUFMetadataError."""
    base, root = fuzz_base
    blob = bytearray(base[: data.draw(st.integers(0, len(base)), label="length")])
    for _ in range(data.draw(st.integers(0, 4), label="flips")):
        if blob:
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    path = root / "damaged.gguf"
    path.write_bytes(bytes(blob))
    try:
        result = read_pooling(path)
    except GGUFMetadataError:
        result = None
    assert result is None or isinstance(result, GGUFPooling)
    ENGINE.build_command(spec_for(path))  # never raises
