"""The decoding rows' attention on a CPU in float32, as a small C function of
our own (``decode_attention.c``), built with the machine's C compiler the
first time a worker needs it and called through ctypes.

Why: a decoding row attends with one token's queries, so its attention is
one pass over its keys and values, and on a CPU that pass is bound by
reading them, cold, since the step's products have just streamed the
weights through the cache. torch's ``scaled_dot_product_attention`` tiles
for long queries and pays for it here: over the slots of 8 rows at context
150, one thread, 417-431 us a layer cold against 199-217 for this function
(bench/README.md, issue 26). It also reads each row's own tokens only, so
the slots need neither padding to the longest nor a mask. vLLM's CPU backend
has its own decoding attention for the same reason.

It is built for this machine and loaded by ``engine.native``; where there
is no compiler, the build fails, or the built function does not give
torch's answers on a small check, the engine attends with torch's kernel
(``sdpa``), and says so once in its log.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp")
# glibc's vector library (the vectorized expf); libgomp, which resolves to
# the one torch has loaded (the same soname): the rows split between the
# engine thread's own OpenMP pool, whose threads spin between its products.
# (A torch built on Intel's OpenMP would get GNU's beside it: the answers the
# same, two pools for the cores.)
LINK_FLAGS = ("-lmvec", "-lm", "-fopenmp")
_I64, _POINTER = ctypes.c_int64, ctypes.c_void_p
_ARGUMENTS = (_POINTER, _I64, _POINTER, _POINTER, _I64, _I64, _POINTER, _POINTER, _POINTER,
              _I64, _I64, _I64, _I64, ctypes.c_float)  # fmt: skip


class DecodeAttention:
    """The built function: ``__call__`` attends each decoding row's queries over
    its own slot's first tokens."""

    def __init__(self, function: Callable[..., int], scale: float) -> None:
        self._function = function
        self._scale = scale

    def __call__(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Row r's queries (``[rows, heads, head_dim]``, each row's heads
        contiguous) over slot ``slots[r]``'s first ``lengths[r]`` tokens of
        ``keys`` and ``values`` (one layer's ``[slots, kv_heads, capacity,
        head_dim]``, each head's tokens contiguous); ``[rows, heads,
        head_dim]``."""
        rows, heads, dim = queries.shape
        out = queries.new_empty((rows, heads, dim))
        status = self._function(
            queries.data_ptr(), queries.stride(0),
            keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
            slots.data_ptr(), lengths.data_ptr(),
            out.data_ptr(), rows, heads, keys.shape[1], dim, self._scale,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("The decoding attention could not allocate its scores.")
        return out


def load(scale: float) -> DecodeAttention | None:
    """The function for a model whose attention scales by ``scale``, built if
    needed; None where it cannot be built or fails its check."""
    try:
        function = native.function(
            SOURCE, COMPILE_FLAGS, LINK_FLAGS, "lmsp_decode_attention", ctypes.c_int, _ARGUMENTS
        )
    except OSError as error:
        log.warning("Decoding attention falls back to torch's kernel: %s", error)
        return None
    attention = DecodeAttention(function, scale)
    difference = _check(attention, scale)
    if not difference <= 1e-4:  # NaN too
        log.warning(
            "Decoding attention falls back to torch's kernel: the built function "
            "differs from it by %.3g on its check.",
            difference,
        )
        return None
    return attention


def _check(attention: DecodeAttention, scale: float) -> float:
    """How far the function's answer is from torch's on a small random case
    (3 rows in slots of different lengths, grouped heads)."""
    generator = torch.Generator().manual_seed(0)
    slots_total, kv_heads, groups, capacity, dim = 4, 2, 3, 40, 64
    keys, values = (
        torch.randn(slots_total, kv_heads, capacity, dim, generator=generator) for _ in "kv"
    )
    queries = torch.randn(3, kv_heads * groups, dim, generator=generator)
    slots, lengths = torch.tensor([2, 0, 3]), torch.tensor([17, 40, 1])
    ours = attention(queries, keys, values, slots, lengths)
    worst = 0.0
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
        theirs = F.scaled_dot_product_attention(
            queries[row].view(kv_heads, groups, dim),
            keys[slot, :, :length],
            values[slot, :, :length],
            scale=scale,
        ).view(kv_heads * groups, dim)
        worst = max(worst, float((theirs - ours[row]).abs().max()))
    return worst
