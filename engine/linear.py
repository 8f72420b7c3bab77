"""The products of a model's linear layers, in the layouts that compute them fastest.

Why: a decoding step reads every weight of the model once for a handful of
rows, so on a CPU it is bound by how fast each weight is laid out and
streamed, and torch's ``F.linear`` is slow at both. It hands the weight as
stored (``[out, in]``) to MKL, which lays it out again at every call.

- **Several rows** (a prompt, a batch decoding): oneDNN's packed layout, made
  once at load. 8 rows through SmolLM2-135M's 211 layers took 91 ms
  instead of 189 with ``F.linear`` (bench/README.md, issue 26). vLLM's CPU
  backend packs its weights for oneDNN the same way.
- **One row** (a single stream decoding): a matrix-vector product, bound by
  memory, and which layout streams it fastest depends on the CPU. On an AMD
  EPYC with AVX2, 30 layers' projections and the output layer, one thread,
  took 37.5 ms stored transposed (``[in, out]``, MKL's plain product)
  against 44.6 packed and 50.7 with ``F.linear``; on an Intel Xeon, the
  projections took 32.5 ms against 45.2 packed and 35.3. On an AMD EPYC
  with AVX-512, the 121 products of one SmolLM2 step took 25.0 ms
  transposed against 16.6 ms packed, and the service's single stream went
  from 34.3-35.0 to 47.3-49.1 tokens/s packed (bench/README.md). So the
  layout of one row is measured once per process on the CPU at hand
  (``one_row_transposed``). From two rows on, the packed kernel wins: 50.2
  ms against 54.2 transposed on the first EPYC.

So ``auto`` holds a CPU's float32 weights packed, and transposed too where
that computes one row faster, beside the model's own as loaded (for
``model.generate``, the eager path): up to three copies, 1.6 GB for
SmolLM2-135M. ``packed`` holds them packed alone beside
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

LAYOUTS = ("auto", "packed", "torch")
_linear_packed = torch.ops.mkldnn._linear_pointwise.default
_pack = torch.ops.mkldnn._reorder_linear_weight


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build packs weights of ``dtype`` on ``device``: float32 on
    a CPU with oneDNN (other dtypes and GPUs keep ``F.linear``)."""
    return bool(
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


@functools.cache
def one_row_transposed() -> bool:
    """Whether this CPU computes one row's product faster from weights stored
    transposed (MKL) than from packed ones (oneDNN): timed once per process
    on the calling thread's threads, over 96 MB of weights in each layout (a
    model's, not a cache's worth), each layout's best of 5 rounds, the rounds
    alternated."""
    weights = [torch.randn(2048, 1024) for _ in range(12)]
    x = torch.randn(1, 1024)
    packed = [_pack(weight, None) for weight in weights]
    transposed = [weight.t().contiguous() for weight in weights]
    del weights
    products: dict[str, Callable[[], object]] = {
        "transposed": lambda: [torch.mm(x, weight) for weight in transposed],
        "packed": lambda: [_linear_packed(x, weight, None, "none", [], "") for weight in packed],
    }
    best = dict.fromkeys(products, float("inf"))
    with torch.inference_mode():
        for _ in range(5):
            for layout, product in products.items():
                started = time.perf_counter()
                product()
                product()
                best[layout] = min(best[layout], time.perf_counter() - started)
    return best["transposed"] < best["packed"]


class Product:
    """One linear layer, ``x @ weight.T + bias`` over rows ``x`` (``[rows, in]``),
    in ``layout`` (one of ``LAYOUTS``; ``auto`` and ``packed`` need
    ``can_pack``)."""

    __slots__ = ("bias", "packed", "transposed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> None:
        self.bias = bias
        self.weight = weight if layout == "torch" else None
        self.packed = _pack(weight, None) if layout != "torch" else None
        self.transposed = (
            weight.t().contiguous() if layout == "auto" and one_row_transposed() else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed is not None and x.shape[0] == 1:
            if self.bias is None:
                return torch.mm(x, self.transposed)
            return torch.addmm(self.bias, x, self.transposed)
        if self.packed is not None:
            return _linear_packed(x, self.packed, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)
