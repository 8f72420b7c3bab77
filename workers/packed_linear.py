"""Linear layers whose weights are packed once for oneDNN, on a CPU.

Why: torch's ``F.linear`` on a CPU calls MKL's GEMM with the weight as it
is stored, and MKL lays it out again for its kernels at every call. A
decoding step is a handful of rows through every weight of the model, so
that work is paid for every weight at every step: on the 2-core CPU, 8
rows through SmolLM2-135M's 211 linear layers took 189 ms with
``F.linear`` and 91 ms with the weights packed once (bench/README.md,
issue 26). vLLM's CPU backend packs its weights for oneDNN the same way.
The packed layout is oneDNN's own (an opaque ``mkldnn`` tensor): the model
serves, it is not trained or saved.

A step of one or two tokens can be the exception: MKL's product of one row
is a matrix-vector product that streams the weight as stored, and on an
Intel AVX-512 machine it beat oneDNN's packed kernel (30 layers'
projections, one thread: 35.3 ms against 45.2 at one row, 42.2 against
46.5 at two, 57.3 against 42.2 at four; one row's engine step took 57.3-59.3
ms with both kept against 66.6-66.7 packed), while on an AMD one it lost
(29.4 ms against 17.1 at one row, 40.6 against 16.7 at two). Which is faster
is a property of the machine, so it is measured where the model loads
(``keep_torch_steps_where_faster``): over the model's own layers, medians of
alternated rounds. A layer that keeps its weight as stored sends steps of
up to the tokens measured faster through ``F.linear``; where none was, the
weights as stored are let go and held once, packed.

Packing changes the order of the additions inside a product, so logits
move in their last bits (at most 3e-5 here); ``bench/greedy_parity.py``
compares the greedy answers with those of torch's own layers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# The most tokens a step may have and still go through F.linear where a layer
# kept its weight: beyond two, the packed kernel won on every machine measured.
TORCH_STEP_TOKENS = 2
# Alternated rounds of each product per step size, when measuring at load.
MEASURED_ROUNDS = 5


class PackedLinear(torch.nn.Module):  # type: ignore[misc]  # torch is read as Any
    """``nn.Linear`` with its weight in oneDNN's packed layout (inference
    only), and as stored too where ``keep_weight``, for steps of up to
    ``TORCH_STEP_TOKENS`` tokens (fewer once ``limit_torch_steps`` says so)."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.weight = linear.weight if keep_weight else None
        self.bias = linear.bias
        self._torch_up_to = TORCH_STEP_TOKENS * self.in_features if keep_weight else 0

    def limit_torch_steps(self, tokens: int) -> None:
        """Send steps of up to ``tokens`` tokens (at most ``TORCH_STEP_TOKENS``)
        through torch's product; 0 lets the weight as stored go."""
        if not 0 <= tokens <= TORCH_STEP_TOKENS or (tokens and self.weight is None):
            raise ValueError(f"Cannot send steps of {tokens} tokens through torch's product.")
        self._torch_up_to = tokens * self.in_features
        if not tokens:
            self.weight = None

    @property
    def torch_step_tokens(self) -> int:
        """The most tokens a step may have to go through torch's product."""
        return int(self._torch_up_to // self.in_features)

    def packed_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self._torch_up_to:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self.packed_product(x)

    def extra_repr(self) -> str:
        kept = ", weight kept" if self.weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed{kept}"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build packs weights of ``dtype`` on ``device``: float32 on
    a CPU with oneDNN (other dtypes and GPUs keep torch's own layers)."""
    return bool(
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def pack_linear_layers(model: torch.nn.Module, keep_weights: bool) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (that
    keeps its weight as stored too where ``keep_weights``); returns how
    many. A weight tied to another module (the output layer to the
    embedding) stays where else it is used; the layer gets a packed copy."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child, keep_weights))
                replaced += 1
    return replaced


def _seconds(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _torch_faster_at(layers: list[PackedLinear], tokens: int) -> bool:
    """Whether steps of ``tokens`` tokens go faster through torch's product
    than through the packed one, over ``layers`` (medians of alternated rounds)."""
    inputs = {n: torch.randn(tokens, n) for n in {m.in_features for m in layers}}

    def through_torch() -> None:
        for m in layers:
            torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)

    def packed() -> None:
        for m in layers:
            m.packed_product(inputs[m.in_features])

    through_torch()  # warm-up: the first calls allocate and pick their kernels
    packed()
    rounds = [(_seconds(through_torch), _seconds(packed)) for _ in range(MEASURED_ROUNDS)]
    return statistics.median(t for t, _ in rounds) < statistics.median(p for _, p in rounds)


def keep_torch_steps_where_faster(model: torch.nn.Module, threads: int) -> int:
    """Measure, over ``model``'s packed layers that kept their weights and on
    ``threads`` OpenMP threads (0: torch's count), up to how many tokens a
    step goes faster through torch's product than through the packed one,
    and limit every layer to that (``PackedLinear.limit_torch_steps``; 0:
    none faster, the weights as stored let go). Returns the tokens."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.weight is not None]
    if not layers:
        return 0
    kept_threads = torch.get_num_threads()
    if threads:  # the engine's own count: the measure is of its steps
        torch.set_num_threads(threads)
    faster = 0
    try:
        with torch.inference_mode():
            while faster < TORCH_STEP_TOKENS and _torch_faster_at(layers, faster + 1):
                faster += 1
    finally:
        torch.set_num_threads(kept_threads)
    for m in layers:
        m.limit_torch_steps(faster)
    return faster
