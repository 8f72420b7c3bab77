"""The decoding rows' attention built from C (``workers.decode_attention``)
beside torch's ``scaled_dot_product_attention``: rows in slots taken out of
order, each over its own number of tokens, query heads grouped over shared
key/value heads in blocks of four and a remainder, at the head sizes it is
compiled for and another. Loading it leaves the process's floating point as
it was; where it cannot be built, the engine keeps torch's kernel."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers import decode_attention


@pytest.fixture(scope="module")
def attention(tmp_path_factory: pytest.TempPathFactory) -> decode_attention.DecodeAttention:
    if decode_attention.compiler() is None:
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
    with caplog.at_level(logging.WARNING, logger="workers.decode_attention"):
        assert decode_attention.load(scale=0.125) is None
    assert "falls back to torch's kernel" in caplog.text
