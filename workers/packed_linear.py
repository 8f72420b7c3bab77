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

A step of one or two tokens is the exception: MKL's product of one row is
a matrix-vector product that streams the weight as stored, and on an
AVX-512 machine it beat oneDNN's packed kernel (30 layers' projections,
one thread: 35.3 ms against 45.2 at one row, 42.2 against 46.5 at two,
44.5-46.3 against 42.5-48.4 at three, 57.3 against 42.2 at four; one
row's engine step took 55.6-60.8 ms with torch's layers against 73.0-76.1
packed, and 57.3-59.3 with both kept against 66.6-66.7). A layer that
keeps its weight as stored (``keep_weight``) sends such steps through
``F.linear``; the price is the weights held twice.

Packing changes the order of the additions inside a product, so logits
move in their last bits (at most 3e-5 here); ``bench/greedy_parity.py``
compares the greedy answers with those of torch's own layers.
"""

from __future__ import annotations

import torch

# A step of at most this many tokens goes through F.linear where a layer kept
# its weight: MKL's small products beat the packed kernel up to here.
TORCH_STEP_TOKENS = 2


class PackedLinear(torch.nn.Module):  # type: ignore[misc]  # torch is read as Any
    """``nn.Linear`` with its weight in oneDNN's packed layout (inference
    only), and as stored too where ``keep_weight``, for steps of up to
    ``TORCH_STEP_TOKENS`` tokens."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.weight = linear.weight if keep_weight else None
        self.bias = linear.bias
        self._torch_up_to = TORCH_STEP_TOKENS * self.in_features if keep_weight else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self._torch_up_to:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

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
