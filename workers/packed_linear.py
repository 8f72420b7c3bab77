"""Linear layers whose weights are packed once for oneDNN, on a CPU.

Why: torch's ``F.linear`` on a CPU calls MKL's GEMM with the weight as it
is stored, and MKL lays it out again for its kernels at every call. A
decoding step is a handful of rows through every weight of the model, so
that work is paid for every weight at every step: on the 2-core CPU, 8
rows through SmolLM2-135M's 211 linear layers took 189 ms with
``F.linear`` and 91 ms with the weights packed once (one row: 101 and 73
ms; bench/README.md, issue 26). vLLM's CPU backend packs its weights for
oneDNN the same way. The packed layout is oneDNN's own (an opaque
``mkldnn`` tensor), so a packed layer holds it instead of a ``weight``
parameter: the model serves, it is not trained or saved.

Packing changes the order of the additions inside a product, so logits
move in their last bits (at most 3e-5 here); ``bench/greedy_parity.py``
compares the greedy answers with those of torch's own layers.
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):  # type: ignore[misc]  # torch is read as Any
    """``nn.Linear`` with its weight in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build packs weights of ``dtype`` on ``device``: float32 on
    a CPU with oneDNN (other dtypes and GPUs keep torch's own layers)."""
    return bool(
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns
    how many. A weight tied to another module (the output layer to the
    embedding) stays where else it is used; the layer gets a packed copy."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
