"""The engine's forward pass (``engine.decoder``) beside transformers' own, on
small models of each architecture it runs, made from their configurations
with random weights (nothing is downloaded): the same logits for a prompt
and the decoding steps after it, alone and two requests attending together,
in every layout of the linear layers (``engine.linear``), the decoding rows
attending through the engine's own function (``engine.decode_attention``)
and through torch's kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine import native
from engine.decoder import Decoder, Decoding, Span, StepMemory, unsupported
from engine.kv_cache import KVCache
from engine.linear import LAYOUTS, can_pack

SIZES = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 32,
}
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES)),
    "qwen2 (biases on q, k, v)": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES)),
    "qwen3 (queries and keys normalised)": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES)),
}
FIRST = [5, 17, 3, 60, 41, 8, 22, 90, 13, 7, 55, 2]  # a prompt of 9, then 3 tokens decoded
SECOND = [31, 4, 77, 12, 9]  # a prompt of 3, then 2 decoded beside the first


def built(kind: str, layout: str, decoding: str) -> tuple[torch.nn.Module, Decoder, KVCache]:
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    with torch.no_grad():
        for parameter in model.parameters():  # norms and biases not all ones and zeros
            parameter.add_(torch.randn_like(parameter) * 0.02)
    decoder = Decoder(model, layout, "sdpa")
    if decoding == "ours":
        if native.compiler() is None:
            pytest.skip("no C compiler to build the decoding attention with")
        assert decoder.decode_attention is not None
    else:
        decoder.decode_attention = None  # torch's kernel over padded slots
    memory = KVCache(2, 2, 16, torch.float32, torch.device("cpu"), max_slots=2)
    return model, decoder, memory


def reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits after each of ``ids``, in one forward pass."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def prefill(decoder: Decoder, memory: KVCache, request: int, ids: list[int]) -> torch.Tensor:
    slot = memory.room(request, len(ids))
    step = StepMemory(memory.keys, memory.values, None, [Span(0, len(ids), slot, 0, None)])
    return decoder.forward(
        torch.tensor(ids), torch.arange(len(ids)), step, torch.tensor([len(ids) - 1])
    )[0]


def decode(decoder: Decoder, memory: KVCache, rows: dict[int, tuple[int, int]]) -> torch.Tensor:
    """One step of one token per request (``rows``: request -> its token and
    position), attending together over their slots."""
    slots = [memory.room(request, position + 1) for request, (_, position) in rows.items()]
    positions = [position for _, position in rows.values()]
    length, slot_count = max(positions) + 1, max(slots) + 1
    seen = torch.ones(slot_count, dtype=torch.long)  # a slot without a row: its first token
    seen[slots] = torch.tensor(positions) + 1
    mask = (torch.arange(length)[None, :] < seen[:, None])[:, None, None, :]
    decoding = Decoding(
        rows=len(rows),
        slots=torch.tensor(slots),
        positions=torch.tensor(positions),
        lengths=torch.tensor(positions) + 1,
        slot_count=slot_count,
        length=length,
        mask=None if bool(mask.all()) else mask,
        in_order=slots == list(range(slot_count)),
    )
    step = StepMemory(memory.keys, memory.values, decoding, [])
    ids = torch.tensor([token for token, _ in rows.values()])
    return decoder.forward(ids, torch.tensor(positions), step, torch.arange(len(rows)))


@pytest.mark.parametrize("decoding", ["ours", "torch's"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", MODELS)
def test_the_decoder_computes_transformers_logits(kind: str, layout: str, decoding: str) -> None:
    if layout != "torch" and not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("this build of torch packs no weights")  # CPU builds with oneDNN do
    model, decoder, memory = built(kind, layout, decoding)
    first, second = reference(model, FIRST), reference(model, SECOND)
    close = {"atol": 1e-5, "rtol": 1e-4}
    with torch.inference_mode():
        assert torch.allclose(prefill(decoder, memory, 1, FIRST[:9]), first[8], **close)
        # Alone: one row of one token a step.
        for position in (9, 10):
            logits = decode(decoder, memory, {1: (FIRST[position], position)})
            assert torch.allclose(logits[0], first[position], **close)
        # Two requests at different lengths attend together, the shorter masked.
        assert torch.allclose(prefill(decoder, memory, 2, SECOND[:3]), second[2], **close)
        for step in range(2):
            logits = decode(
                decoder, memory, {1: (FIRST[11], 11), 2: (SECOND[3], 3)} if step == 0 else {
                    2: (SECOND[4], 4)
                },
            )  # fmt: skip
            if step == 0:
                assert torch.allclose(logits[0], first[11], **close)
            assert torch.allclose(logits[-1], second[3 + step], **close)


def test_models_the_engine_cannot_run_are_refused_with_the_reason() -> None:
    assert unsupported(LlamaConfig(**SIZES)) is None
    gemma = AutoConfig.for_model("gemma", **SIZES)
    assert "architecture 'gemma'" in (unsupported(gemma) or "")
    windowed = MistralConfig(**SIZES, sliding_window=8)
    assert "sliding-window" in (unsupported(windowed) or "")
    dynamic = LlamaConfig(**SIZES, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert "rotary embedding 'dynamic'" in (unsupported(dynamic) or "")
    with pytest.raises(ValueError, match="cannot run this model: architecture 'gemma'"):
        Decoder(AutoModelForCausalLM.from_config(gemma), "torch", "sdpa")


# --- at length: eight requests of several hundred tokens, attention far from uniform ---------

LONG_SIZES = {**SIZES, "max_position_embeddings": 1024}
LENGTHS = (300, 471, 257, 412, 333, 389, 266, 448)  # eight prompts, no two alike
SHARPEN = 12.0  # queries and keys scaled up: scores of several units, not near zero
DECODED = 2  # tokens decoded after each prompt, all eight rows together


def long_model(kind: str) -> torch.nn.Module:
    """``kind``'s small model with a context of 1,024 positions, eager attention
    (transformers hands its weights back) and queries and keys scaled so that
    each row attends to a few tokens, not evenly to all: a wrong mask or a
    wrong position then changes the logits well past the tolerance."""
    config = {
        "llama": LlamaConfig,
        "qwen2 (biases on q, k, v)": Qwen2Config,
        "qwen3 (queries and keys normalised)": Qwen3Config,
    }[kind](**LONG_SIZES, attn_implementation="eager")
    causal = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}
    torch.manual_seed(1)
    model = causal[kind.split()[0]](config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
            if name.endswith(("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")):
                parameter.mul_(SHARPEN if "proj" in name else SHARPEN**0.5)
    return model


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    return [
        torch.randint(0, SIZES["vocab_size"], (length + DECODED,), generator=generator).tolist()
        for length in LENGTHS
    ]


def peak_attention(model: torch.nn.Module, ids: list[int]) -> float:
    """The last token's largest attention weight, times the number of tokens it
    attends over (1 when uniform), averaged over layers and heads."""
    with torch.inference_mode():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    peaks = [layer[0, :, -1, :].max(dim=-1).values * len(ids) for layer in attentions]
    return float(torch.cat(peaks).mean())


@pytest.mark.parametrize("decoding", ["ours", "torch's"])
@pytest.mark.parametrize("kind", MODELS)
def test_eight_long_prompts_of_different_lengths_decode_together_as_transformers(
    kind: str, decoding: str
) -> None:
    model = long_model(kind)
    decoder = Decoder(model, "torch", "sdpa")
    if decoding == "ours":
        if native.compiler() is None:
            pytest.skip("no C compiler to build the decoding attention with")
        assert decoder.decode_attention is not None
    else:
        decoder.decode_attention = None
    memory = KVCache(2, 2, 16, torch.float32, torch.device("cpu"), max_slots=len(LENGTHS))
    rows = prompts()
    # the premise: each row attends sharply (uniform attention hides masks and positions)
    assert min(peak_attention(model, ids) for ids in rows[:2]) > 20
    expected = [reference(model, ids) for ids in rows]
    close = {"atol": 1e-4, "rtol": 1e-4}
    with torch.inference_mode():
        for request, (ids, length) in enumerate(zip(rows, LENGTHS, strict=True)):
            logits = prefill(decoder, memory, request, ids[:length])
            assert torch.allclose(logits, expected[request][length - 1], **close), request
        for step in range(DECODED):
            logits = decode(
                decoder,
                memory,
                {
                    request: (ids[length + step], length + step)
                    for request, (ids, length) in enumerate(zip(rows, LENGTHS, strict=True))
                },
            )
            for request, length in enumerate(LENGTHS):
                wanted = expected[request][length + step]
                assert torch.allclose(logits[request], wanted, **close), (request, step)
