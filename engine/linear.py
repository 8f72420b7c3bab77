"""The products of a model's linear layers, in the layouts that compute them fastest.

Why: a decoding step reads every weight of the model once for a handful of
rows, so on a CPU it is bound by how fast each weight is laid out and
streamed, and torch's ``F.linear`` is slow at both. It hands the weight as
stored (``[out, in]``) to MKL, which lays it out again at every call.

- **Several rows** (a prompt's chunks, a step wider than ``blocked_rows``):
  oneDNN's packed layout, made once at load. 8 rows through SmolLM2-135M's
  211 layers took 91 ms instead of 189 with ``F.linear`` (bench/README.md,
  issue 26). vLLM's CPU backend packs its weights for oneDNN the same way.
- **A decoding step's few rows** (up to ``blocked_rows``): the
  weight in blocks of 16 output columns for a C function of our own
  (``engine.row_products``), made once at load where it builds: 8 rows of
  SmolLM2-135M's 121 products in 33.7-34.6 ms against oneDNN's 43.0-43.9,
  one row as fast as MKL's plain product over weights stored transposed
  (2-core Xeon, AVX-512; bench/README.md, issue 42). A row's answer is the
  same bits whatever rows step beside it.

So ``auto`` holds a CPU's float32 weights packed and in blocks, beside the
model's own as loaded (for ``model.generate``, the eager path): three
copies, 1.6 GB for SmolLM2-135M. ``packed`` holds them packed alone beside
the model's own; ``torch`` computes with ``F.linear`` over the model's own
weights, the only choice on a GPU and in other dtypes.

The engine's thread computes them on all of its OpenMP threads, every core
by default (``workers.loading.engine_threads``).

Each layout adds a product's terms in its own order, so logits move in their
last bits (at most 1e-4 here); ``bench/greedy_parity.py`` compares the greedy
answers with those of transformers' own layers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from . import row_products

LAYOUTS = ("auto", "packed", "torch")
_linear_packed = torch.ops.mkldnn._linear_pointwise.default
_pack = torch.ops.mkldnn._reorder_linear_weight


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build packs weights of ``dtype`` on ``device``: float32 on
    a CPU with oneDNN (other dtypes and GPUs keep ``F.linear``)."""
    return bool(
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


# Row counts at which the layouts are timed against each other (``blocked_rows``).
TIMED_ROWS = (1, 4, 8, 16, 32)


@functools.cache
def blocked_rows() -> int:
    """The most rows of a step this CPU computes faster in blocks
    (``engine.row_products``) than with oneDNN's packed weights, of
    ``TIMED_ROWS``; 0 where the function cannot be built, or where one row
    is faster packed. Timed once per process on the calling thread's
    threads, over 96 MB of weights in each layout (a model's, not a cache's
    worth), each layout's best of 3 rounds, the rounds alternated: AVX-512
    and AVX2 builds differ, and so do CPUs (about 0.5 s)."""
    products = row_products.load()
    if products is None:
        return 0
    weights = [torch.randn(2048, 1024) for _ in range(12)]
    packed = [_pack(weight, None) for weight in weights]
    blocks = [products.lay_out(weight) for weight in weights]
    del weights
    layouts: dict[str, Callable[[torch.Tensor], object]] = {
        "blocks": lambda x: [products(x, block, None, 2048) for block in blocks],
        "packed": lambda x: [_linear_packed(x, p, None, "none", [], "") for p in packed],
    }
    fastest = 0
    with torch.inference_mode():
        for rows in TIMED_ROWS:
            x = torch.randn(rows, 1024)
            best = dict.fromkeys(layouts, float("inf"))
            for _ in range(3):
                for layout, product in layouts.items():
                    started = time.perf_counter()
                    product(x)
                    best[layout] = min(best[layout], time.perf_counter() - started)
            if best["blocks"] >= best["packed"]:
                break
            fastest = rows
    return fastest


class Product:
    """One linear layer, ``x @ weight.T + bias`` over rows ``x`` (``[rows, in]``),
    in ``layout`` (one of ``LAYOUTS``; ``auto`` and ``packed`` need
    ``can_pack``)."""

    __slots__ = (
        "bias",
        "blocked_bias",
        "blocked_rows",
        "blocks",
        "few_rows",
        "out",
        "packed",
        "weight",
    )

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> None:
        self.bias = bias
        self.out = weight.shape[0]
        self.weight = weight if layout == "torch" else None
        self.packed = _pack(weight, None) if layout != "torch" else None
        # A decoding step's rows, where the function builds and wins on this CPU.
        self.blocked_rows = blocked_rows() if layout == "auto" else 0
        self.few_rows = row_products.load() if self.blocked_rows else None
        self.blocks = self.few_rows.lay_out(weight) if self.few_rows is not None else None
        self.blocked_bias = (
            self.few_rows.lay_out(bias) if self.few_rows is not None and bias is not None else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and x.shape[0] <= self.blocked_rows:
            assert self.blocks is not None
            return self.few_rows(x, self.blocks, self.blocked_bias, self.out)
        if self.packed is not None:
            return _linear_packed(x, self.packed, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)
