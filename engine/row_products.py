"""The products of a decoding step's few rows with a linear layer's weight,
on a CPU in float32, as a small C function of our own (``row_products.c``),
built for this machine and loaded by ``engine.native``.

Why: a step of a handful of rows reads every weight of the model once and
does little with each, so it is bound by how fast the weights stream and by
how many sums are in flight while they do. oneDNN's packed kernel, made for
wider products, computed 8 rows of SmolLM2-135M's 121 products in 43.0-43.9
ms and one in 35.6-37.0; laid out in blocks of 16 columns and summed 8 rows
by 2 blocks at a time in registers, 33.7-34.6 and 25.1-25.4 ms
(``bench/profile_step.py --linear packed`` and ``auto``, 2-core Xeon,
AVX-512; the 8-row step 66.6-67.5 ms against 51.7-54.2). Apart, the same
products with random weights, medians of 12 alternated rounds: one row 24.0
ms against 24.1 by MKL over weights stored transposed (``auto``'s layout
for one row before), 2 rows 25.7 against 32.7 and oneDNN's 34.1, 32 rows
56.7 against 63.7 (oneDNN's). Up to how many rows a step is computed here
is timed on the CPU at hand when a model loads (``engine.linear.blocked_rows``);
wider steps, and a prompt's chunks, keep oneDNN's kernel (bench/README.md,
issue 42).

Each output is summed in its inputs' order whatever rows it is computed
beside (``row_products.c``), so a request's logits, and its greedy answer,
are the same bits in a batch as alone. Where there is no compiler, the build
fails or the built function does not give torch's answers on a small check,
the engine computes every step with oneDNN's kernel, and says so once in its
log.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_products.c")
# No -ffast-math: each output's terms are added in order, the same in any tile.
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)  # libgomp: torch's own, the same soname (decode_attention.py)
BLOCK = 16  # output columns a block holds (row_products.c)
_I64, _POINTER = ctypes.c_int64, ctypes.c_void_p
_ARGUMENTS = (_POINTER, _I64, _I64, _I64, _POINTER, _POINTER, _I64, _POINTER, _I64)


class RowProducts:
    """The built function: ``__call__`` computes rows with a weight that
    ``lay_out`` has put in blocks."""

    def __init__(self, function: Callable[..., None]) -> None:
        self._function = function

    @staticmethod
    def lay_out(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (``[out, in]``) in blocks of ``BLOCK`` output columns,
        each block's columns side by side for every input (``[blocks, in,
        BLOCK]``), the last block padded with zeros; a bias (``[out]``) is
        padded alike (``[blocks, BLOCK]``)."""
        out = weight.shape[0]
        blocks = -(-out // BLOCK)
        padded = F.pad(
            weight.detach().float(), (0, 0) * (weight.dim() - 1) + (0, blocks * BLOCK - out)
        )
        if weight.dim() == 1:
            return padded.view(blocks, BLOCK).contiguous()
        return padded.view(blocks, BLOCK, weight.shape[1]).transpose(1, 2).contiguous()

    def __call__(
        self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, out: int
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for rows ``x`` (``[rows, in]``), the weight
        and bias as ``lay_out`` gave them; ``[rows, out]``."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, width = x.shape
        y = x.new_empty((rows, out))
        self._function(
            x.data_ptr(), x.stride(0), rows, width, blocks.data_ptr(),
            None if bias is None else bias.data_ptr(), out, y.data_ptr(), y.stride(0),
        )  # fmt: skip
        return y


@functools.cache
def load() -> RowProducts | None:
    """The function, built if needed (once a process); None where it cannot
    be built or fails its check."""
    try:
        function = native.function(
            SOURCE, COMPILE_FLAGS, LINK_FLAGS, "lmsp_row_products", None, _ARGUMENTS
        )
    except OSError as error:
        log.warning("Decoding steps' products fall back to oneDNN's kernel: %s", error)
        return None
    products = RowProducts(function)
    difference = _check(products)
    if not difference <= 1e-4:  # NaN too
        log.warning(
            "Decoding steps' products fall back to oneDNN's kernel: the built function "
            "differs from torch's by %.3g on its check.",
            difference,
        )
        return None
    return products


def _check(products: RowProducts) -> float:
    """How far the function's answer is from torch's on a small random case
    (every row count up to two tiles of 8 and one more, a last block part
    empty, a bias)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3 * BLOCK + 5, 70, generator=generator)
    bias = torch.randn(weight.shape[0], generator=generator)
    blocks, padded_bias = products.lay_out(weight), products.lay_out(bias)
    worst = 0.0
    for rows in range(1, 18):
        x = torch.randn(rows, weight.shape[1], generator=generator)
        ours = products(x, blocks, padded_bias, weight.shape[0])
        worst = max(worst, float((ours - F.linear(x, weight, bias)).abs().max()))
    return worst
