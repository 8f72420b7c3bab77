"""The decoding rows' attention built from C (``engine.decode_attention``)
beside torch's ``scaled_dot_product_attention``: rows in slots taken out of
order, each over its own number of tokens, query heads grouped over shared
key/value heads in blocks of four and a remainder, at the head sizes it is
compiled for and another. Loading it leaves the process's floating point as
it was; where it cannot be built, the engine keeps torch's kernel. A library
in a cache folder that others may write to, or of another user, or whose
bytes differ from those built, is never loaded (its constructors never run)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import decode_attention, native


@pytest.fixture(scope="module")
def attention(tmp_path_factory: pytest.TempPathFactory) -> decode_attention.DecodeAttention:
    if native.compiler() is None:
        pytest.skip("no C compiler to build the decoding attention with")
    cache = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMSP_KERNEL_CACHE", str(cache))  # built here, not found built
        built = decode_attention.load(scale=0.125)
    assert built is not None  # a compiler is here: it must build and pass its check
    assert [path.suffix for path in cache.iterdir()] == [".so"]  # the build left only the library
    return built


@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (14, 2), (4, 4), (16, 8)])
def test_each_row_attends_over_its_own_slot_as_torch_does(
    attention: decode_attention.DecodeAttention, heads: int, kv_heads: int, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(heads * head_dim)
    capacity = 300
    keys, values = (torch.randn(5, kv_heads, capacity, head_dim, generator=generator) for _ in "kv")
    # Rows are taken from a wider step's queries (each row's heads contiguous).
    step = torch.randn(4, heads + kv_heads, head_dim, generator=generator)
    queries = step[:, :heads]
    slots, lengths = torch.tensor([3, 0, 4, 1]), torch.tensor([1, 300, 129, 17])
    ours = attention(queries, keys, values, slots, lengths)
    groups = heads // kv_heads
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
        torch_answer = F.scaled_dot_product_attention(
            queries[row].reshape(kv_heads, groups, head_dim),
            keys[slot, :, :length],
            values[slot, :, :length],
            scale=0.125,
        ).reshape(heads, head_dim)
        assert torch.allclose(ours[row], torch_answer, atol=1e-5, rtol=1e-4)


def test_loading_it_leaves_subnormal_numbers_alone(
    attention: decode_attention.DecodeAttention,
) -> None:
    # A library linked with -ffast-math would switch the process to
    # flush-to-zero, and torch's own arithmetic with it.
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert float((tiny * 0.5)[0]) > 0.0


def test_without_a_compiler_the_engine_keeps_torchs_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LMSP_KERNEL_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="engine.decode_attention"):
        assert decode_attention.load(scale=0.125) is None
    assert "falls back to torch's kernel" in caplog.text


PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) { fputs("ran", marker); fclose(marker); }
}
"""


@pytest.fixture()
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """A real library whose constructor writes a marker file when it is
    loaded, and the marker's path (not there yet)."""
    compiler = native.compiler()
    if compiler is None:
        pytest.skip("no C compiler to build the planted library with")
    marker, source, library = (
        tmp_path / "constructor-ran",
        tmp_path / "planted.c",
        tmp_path / "planted.so",
    )
    source.write_text(PLANTED)
    subprocess.run(
        [compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(library)],
        check=True,
    )
    ctypes.CDLL(str(library))  # the planted library works: loading it writes the marker
    assert marker.read_text() == "ran"
    marker.unlink()
    return library, marker


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A library the cache built (loaded in this process, so tests copy it
    into folders of their own: the loader opens a path once)."""
    if native.compiler() is None:
        pytest.skip("no C compiler to build the decoding attention with")
    cache = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMSP_KERNEL_CACHE", str(cache))
        assert decode_attention.load(scale=0.125) is not None
    (library,) = cache.iterdir()
    return library


def _cache_with(built: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache folder holding a copy of the built library; the copy."""
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("LMSP_KERNEL_CACHE", str(cache))
    library = cache / built.name
    shutil.copy2(built, library)
    return library


def test_a_library_planted_in_a_folder_others_may_write_is_never_loaded(
    built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    planted: tuple[Path, Path],
) -> None:
    planted_library, marker = planted
    cache = tmp_path / "kernels"
    library = _cache_with(built, cache, monkeypatch)
    cache.chmod(0o777)  # a shared folder: another user put this under the library's name
    shutil.copyfile(planted_library, library)
    with caplog.at_level(logging.WARNING, logger="engine.decode_attention"):
        assert decode_attention.load(scale=0.125) is None
    assert not marker.exists()  # its constructor never ran
    assert "writable by its group or others" in caplog.text
    assert "falls back to torch's kernel" in caplog.text


def test_a_cache_folder_or_library_of_another_user_is_refused(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "kernels"
    library = _cache_with(built, cache, monkeypatch)
    someone_else = os.geteuid() + 1
    for path in (library, cache):
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(path, someone_else, -1)
        with caplog.at_level(logging.WARNING, logger="engine.decode_attention"):
            assert decode_attention.load(scale=0.125) is None
        assert f"belongs to user {someone_else}, not this one" in caplog.text
        caplog.clear()


def test_a_library_others_may_write_is_refused(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    library = _cache_with(built, tmp_path / "kernels", monkeypatch)
    library.chmod(0o775)
    with caplog.at_level(logging.WARNING, logger="engine.decode_attention"):
        assert decode_attention.load(scale=0.125) is None
    assert f"the kernel cache library {library} is writable by its group or others" in caplog.text


def test_a_tampered_library_in_a_private_folder_is_refused_by_its_digest(
    built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    planted: tuple[Path, Path],
) -> None:
    planted_library, marker = planted
    cache = tmp_path / "kernels"
    library = _cache_with(built, cache, monkeypatch)
    shutil.copyfile(planted_library, library)  # same name, other bytes
    with caplog.at_level(logging.WARNING, logger="engine.decode_attention"):
        assert decode_attention.load(scale=0.125) is not None  # built again, and checked
    assert not marker.exists()  # the tampered library's constructor never ran
    assert "does not match its digest; built again" in caplog.text
    (rebuilt,) = cache.iterdir()
    assert rebuilt.read_bytes() != planted_library.read_bytes()


def test_an_intact_library_in_a_private_folder_is_used_as_it_is(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "kernels"
    library = _cache_with(built, cache, monkeypatch)
    copied = library.stat().st_ino
    assert decode_attention.load(scale=0.125) is not None
    assert list(cache.iterdir()) == [library]
    assert library.stat().st_ino == copied  # not built again
