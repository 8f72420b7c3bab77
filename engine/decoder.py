"""The forward pass of an engine step: a Llama-style model's decoder layers as
plain torch operations over its weights.

Why not the model's own forward: transformers' modules spend a decoding
step's time around the arithmetic (decorators, keyword plumbing, masks and
output records built per call, a module call per product), and a step's
arithmetic is small: one row's step took 54.9-60.4 ms through them against
37.6-38.2 here, eight rows' 75.3-86.4 against 64.7-67.6, one thread each,
the same hour (bench/README.md, issue 26). Here a layer is one normalisation,
one product for q/k/v together, the rotary embedding, attention, the output
product, another normalisation and one product for gate and up together
before the down product. The model's own modules stay as they are for
``model.generate`` (``tests.reference``), the path the engine's answers are
compared with.

What a layer computes is what transformers' Llama, Mistral, Qwen2 and Qwen3
layers compute, operation for operation where that costs nothing (the
norms, the rotary embedding, the attention kernels' arguments), so greedy
answers equal the eager path's; the products differ from ``F.linear`` in
their last bits where their layout does (``engine.linear``).

Attention is the one part that tells the rows of a step apart: each row's
new keys and values are stored in its request's slot of the memory
(``kv_cache``) and its queries attend over that slot's tokens, with the
kernel the model was loaded with (``sdpa`` or ``eager``, as transformers
calls it). The decoding rows (one token each) attend together, one call per
layer (``Decoding``): on a CPU in float32 through ``decode_attention``, each
row over its own slot's tokens, elsewhere through torch's kernel over the
slots padded to the longest; a prompt's chunk attends alone (``Span``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from . import decode_attention
from .linear import Product

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Rotary embeddings whose frequencies do not change with the sequence's length.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
KERNELS = ("sdpa", "eager")


def head_dim(config: PretrainedConfig) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def kv_bytes_per_token(config: PretrainedConfig, dtype_bytes: int) -> int:
    """Bytes of keys and values one token holds, all layers together."""
    per_layer = 2 * int(config.num_key_value_heads) * head_dim(config) * dtype_bytes
    return int(config.num_hidden_layers) * per_layer


def unsupported(config: PretrainedConfig) -> str | None:
    """Why the engine cannot run a model of ``config``, or None when it can."""
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral: a window, when it has one, in every layer
        windowed = getattr(config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if windowed else "full_attention"]
    if config.model_type not in ARCHITECTURES:
        return f"architecture {config.model_type!r} (the engine runs {', '.join(ARCHITECTURES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the engine runs silu)"
    if rope not in STATIC_ROPE:
        return f"rotary embedding {rope!r} (the engine runs {', '.join(STATIC_ROPE)})"
    if any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention (the engine runs full attention)"
    return None


@dataclass(frozen=True)
class Span:
    """A chunk of several tokens in a step (a prompt's): its slice of the packed
    sequence, its request's slot, the position of its first token, and the
    mask its queries need (None: all tokens before them, the kernel's own
    causal path)."""

    begin: int
    end: int
    slot: int
    start: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class Decoding:
    """The step's rows of one token each (decoding), first in its packed
    sequence, attending together: each row over its slot's first ``lengths``
    tokens (``Decoder.attends_by_length``), or over the first ``slot_count``
    slots of the memory padded to their first ``length`` tokens, ``mask``
    (``[slot_count, 1, 1, length]``) telling which each slot's token sees
    (None: all)."""

    rows: int
    slots: torch.Tensor  # each row's slot
    positions: torch.Tensor  # each row's token's position
    lengths: torch.Tensor  # each row's tokens, its own included: positions + 1
    slot_count: int
    length: int
    mask: torch.Tensor | None
    in_order: bool  # the rows are slots 0 to slot_count - 1, in that order


@dataclass(frozen=True)
class StepMemory:
    """What a step's attention reads and writes: the running requests' keys and
    values (``[layers, slots, kv_heads, capacity, head_dim]``, ``kv_cache``),
    the decoding rows attended together, and the chunks attended one by one."""

    keys: torch.Tensor
    values: torch.Tensor
    decoding: Decoding | None
    spans: Sequence[Span]


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Product
    q_norm: torch.Tensor | None  # Qwen3 normalises each head's queries and keys
    k_norm: torch.Tensor | None
    o: Product
    post_norm: torch.Tensor
    gate_up: Product
    down: Product


def _merged(layers: Sequence[Any], layout: str) -> Product:
    """One product for ``layers`` (torch ``Linear`` modules over the same input),
    their outputs side by side. In torch's layout the layers then read their
    rows of its weight instead of holding copies of their own."""
    weight = torch.cat([layer.weight for layer in layers])
    biases = [layer.bias for layer in layers]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("Layers merged into one product need a bias each or none.")
    bias = None if biases[0] is None else torch.cat(biases)
    product = Product(weight, bias, layout)
    if product.weight is not None:
        rows = product.weight.split([layer.out_features for layer in layers])
        for layer, own in zip(layers, rows, strict=True):
            layer.weight.data = own
    return product


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """Each key/value head repeated for the query heads that share it, as
    transformers' ``repeat_kv`` does."""
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    expanded = states[:, :, None].expand(batch, heads, groups, length, dim)
    return expanded.reshape(batch, heads * groups, length, dim)


class Decoder:
    """A loaded Llama-style model's forward pass over packed rows, with its
    linear layers in ``layout`` (``engine.linear``) and attention through
    ``kernel`` (``sdpa`` or ``eager``)."""

    def __init__(self, model: Any, layout: str, kernel: str) -> None:
        config = model.config
        reason = unsupported(config)
        if reason is not None:
            raise ValueError(f"The engine cannot run this model: {reason}.")
        if kernel not in KERNELS:
            raise ValueError(f"Unknown attention kernel {kernel!r} (one of {sorted(KERNELS)}).")
        self.kernel = kernel
        self.device = model.device
        self.dtype = model.dtype
        self.num_layers = int(config.num_hidden_layers)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = head_dim(config)
        self.groups = self.heads // self.kv_heads
        self.vocab_size = int(config.vocab_size)
        self.eps = float(config.rms_norm_eps)
        self.hidden_size = int(config.hidden_size)
        self.intermediate_size = int(config.intermediate_size)
        decoder = model.model
        self.embedding = decoder.embed_tokens.weight
        self.layers = []
        for layer in decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight,
                    _merged([attention.q_proj, attention.k_proj, attention.v_proj], layout),
                    None if q_norm is None else q_norm.weight,
                    None if k_norm is None else k_norm.weight,
                    _merged([attention.o_proj], layout),
                    layer.post_attention_layernorm.weight,
                    _merged([mlp.gate_proj, mlp.up_proj], layout),
                    _merged([mlp.down_proj], layout),
                )
            )
        self.scaling = float(decoder.layers[0].self_attn.scaling)
        self.decode_attention = None
        if kernel == "sdpa" and self.device.type == "cpu" and self.dtype == torch.float32:
            self.decode_attention = decode_attention.load(self.scaling)
        self.norm = decoder.norm.weight
        # The output layer is often tied to the embedding: its weight is left
        # to both, and the product holds copies of its own where it lays it out.
        self.head = Product(model.lm_head.weight, model.lm_head.bias, layout)
        rotary = decoder.rotary_emb
        self._inv_freq = rotary.inv_freq.float()
        self._rotary_scaling = float(rotary.attention_scaling)
        self._cos, self._sin = self._rotary_tables(int(config.max_position_embeddings))

    @property
    def attends_by_length(self) -> bool:
        """Whether the decoding rows attend each over its own slot's tokens,
        needing neither padded slots nor a mask (``Decoding``)."""
        return self.decode_attention is not None

    def _rotary_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cosines and sines of every position below
        ``positions``, as transformers computes them for each step."""
        frequencies = (
            torch.arange(positions, device=self.device)[:, None].float()
            * self._inv_freq.to(self.device)
        )  # fmt: skip
        angles = torch.cat((frequencies, frequencies), dim=-1)
        return (
            (angles.cos() * self._rotary_scaling).to(self.dtype),
            (angles.sin() * self._rotary_scaling).to(self.dtype),
        )

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        memory: StepMemory,
        last: torch.Tensor,
    ) -> torch.Tensor:
        """The logits (``[len(last), vocab]``) after the tokens at indices
        ``last`` of the packed sequence ``ids`` (at ``positions``), each row
        storing its keys and values in ``memory`` and attending over its own."""
        tokens = ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        width = heads * dim  # of the queries, and of attention's output
        keys_end = width + kv_heads * dim
        if int(positions.max()) >= self._cos.shape[0]:
            self._cos, self._sin = self._rotary_tables(2 * int(positions.max()) + 1)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        hidden = F.embedding(ids, self.embedding)
        shape = (self.hidden_size,)
        for index, layer in enumerate(self.layers):
            normed = F.rms_norm(hidden, shape, layer.input_norm, self.eps)
            qkv = layer.qkv(normed)
            query_key = qkv[:, :keys_end].view(tokens, heads + kv_heads, dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                query_key = torch.cat(
                    (
                        F.rms_norm(query_key[:, :heads], (dim,), layer.q_norm, self.eps),
                        F.rms_norm(query_key[:, heads:], (dim,), layer.k_norm, self.eps),
                    ),
                    dim=1,
                )
            rotated = torch.cat((-query_key[..., dim // 2 :], query_key[..., : dim // 2]), dim=-1)
            query_key = query_key * cos + rotated * sin
            values = qkv[:, keys_end:].view(tokens, kv_heads, dim)
            queries, keys = query_key[:, :heads], query_key[:, heads:]
            attended = self._attend(index, queries, keys, values, memory)
            hidden = hidden + layer.o(attended.reshape(tokens, width))
            normed = F.rms_norm(hidden, shape, layer.post_norm, self.eps)
            gate_up = layer.gate_up(normed)
            gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
            hidden = hidden + layer.down(F.silu(gate) * up)
        return self.head(F.rms_norm(hidden[last], shape, self.norm, self.eps))

    def _attend(
        self,
        layer: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        memory: StepMemory,
    ) -> torch.Tensor:
        """Each row's new keys and values (``[tokens, kv_heads, head_dim]``)
        stored in its slot, then its queries (``[tokens, heads, head_dim]``)
        attending over its slot's tokens; ``[tokens, heads, head_dim]``."""
        stored_keys, stored_values = memory.keys[layer], memory.values[layer]
        outputs = []
        decoding = memory.decoding
        if decoding is not None:
            rows, where = decoding.rows, (decoding.slots, decoding.positions)
            stored_keys.transpose(1, 2).index_put_(where, keys[:rows])
            stored_values.transpose(1, 2).index_put_(where, values[:rows])
            outputs.append(self._decode(queries[:rows], stored_keys, stored_values, decoding))
        for span in memory.spans:
            stop = span.start + span.end - span.begin
            slot = slice(span.slot, span.slot + 1)
            new_keys = keys[span.begin : span.end].transpose(0, 1)
            stored_keys[span.slot, :, span.start : stop] = new_keys
            stored_values[span.slot, :, span.start : stop] = values[
                span.begin : span.end
            ].transpose(0, 1)
            query = queries[span.begin : span.end].transpose(0, 1)[None]
            output = self._kernel(
                query, stored_keys[slot, :, :stop], stored_values[slot, :, :stop], span.mask
            )
            outputs.append(output[0].transpose(0, 1))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _decode(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        decoding: Decoding,
    ) -> torch.Tensor:
        """The decoding rows' queries (``[rows, heads, head_dim]``) over their
        slots (``keys``, ``values``: a layer's ``[slots, kv_heads, capacity,
        head_dim]``), in one call: through ``decode_attention`` where it is
        loaded, each row over its own tokens; else through torch's kernel,
        each slot's query heads grouped by the key/value head they share, as
        one query of ``groups`` tokens (what transformers' ``pack_gqa`` does
        for one token), attending over the slots' first ``length`` tokens."""
        if self.decode_attention is not None:
            return self.decode_attention(queries, keys, values, decoding.slots, decoding.lengths)
        slots, length = decoding.slot_count, decoding.length
        if decoding.in_order:
            grouped = queries
        else:  # rows only in some slots: the others' queries are zeros, their outputs dropped
            grouped = queries.new_zeros((slots, self.heads, self.head_dim))
            grouped.index_copy_(0, decoding.slots, queries)
        output = F.scaled_dot_product_attention(
            grouped.view(slots, self.kv_heads, self.groups, self.head_dim),
            keys[:slots, :, :length],
            values[:slots, :, :length],
            attn_mask=decoding.mask,
            scale=self.scaling,
        ).view(slots, self.heads, self.head_dim)
        return output if decoding.in_order else output.index_select(0, decoding.slots)

    def _kernel(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``[1, heads, tokens, head_dim]`` attending over ``[1, kv_heads, n,
        head_dim]``, with the arguments transformers' ``sdpa`` and ``eager``
        functions give their kernels, but for a mask with shared key/value
        heads: ``enable_gqa`` rather than the heads repeated into copies (the
        same answers to the bit; a chunk of 64 of a prompt at 3,000 tokens
        attended in 5.4-7.8 ms a layer against 10.7-11.6, one thread)."""
        if self.kernel == "eager":
            keys, values = _repeat_kv(keys, self.groups), _repeat_kv(values, self.groups)
            weights = torch.matmul(query, keys.transpose(2, 3)) * self.scaling
            if mask is not None:
                weights = weights + mask
            weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
            return torch.matmul(weights, values)
        if mask is None:
            return F.scaled_dot_product_attention(
                query,
                keys,
                values,
                scale=self.scaling,
                is_causal=query.shape[2] > 1,
                enable_gqa=self.groups > 1,
            )
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=self.groups > 1
        )
