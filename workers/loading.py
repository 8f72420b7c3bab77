"""Loading a model onto its device, and its transformers tokenizer: each once per process.

Where a model runs and how much memory its engine may hold come from its
entry in ``models.toml`` (``generation.registry.ModelSpec``): ``device``,
``dtype``, ``attention``, ``linear``, ``cpu_threads``, ``kv_budget_tokens``
and ``prefill_chunk_tokens``, each with a default that suits the device when
left out.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from generation.registry import ModelSpec
from generation.weights import weights_folder

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from engine.decoder import Decoder

log = logging.getLogger(__name__)

# Prompt tokens per step when models.toml leaves it to the device: on the
# 2-core CPU, with chunks of 64, a 3,000-token prompt joining 4 decoding
# streams stretched their longest gap to 2.4 times their median one
# (bench/bench_engine.py --only join; bench/README.md); a GPU takes far
# larger chunks in stride.
CHUNK_TOKENS = {"cpu": 64, "cuda": 512}
# A CPU has the memory for several full contexts; a GPU's budget is derived
# from its free memory instead (``derived_budget``).
CPU_BUDGET_CONTEXTS = 4


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: PreTrainedModel  # transformers' own modules: model.generate, the eager path
    decoder: Decoder  # the engine's forward pass over the same weights
    tokenizer: PreTrainedTokenizerBase
    token_budget: int = 0  # tokens of keys and values its engine may hold
    chunk_tokens: int = 0  # prompt tokens its engine computes per step
    threads: int = 0  # OpenMP threads of its engine's steps (0: torch's own count)
    product_threads: int = 0  # ... of a step's products of several rows (engine.linear)

    @functools.cached_property
    def eos_token_ids(self) -> set[int]:
        """The model's end tokens and the tokenizer's (without touching either's config)."""
        ids = self.model.generation_config.eos_token_id
        ids = list(ids) if isinstance(ids, list) else [ids]
        ids.append(self.tokenizer.eos_token_id)
        return {i for i in ids if i is not None}


@functools.cache
def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(weights_folder(spec))


def derived_budget(spec: ModelSpec, config: PretrainedConfig, token_bytes: int, dtype_bytes: int,
                   free: int, total: int, chunk_tokens: int) -> int:  # fmt: skip
    """A GPU's token budget: what ``gpu_memory_fraction`` of the device leaves
    once the weights are loaded (``free`` counts them out already), less the
    room a step's activations and logits take, in tokens of ``token_bytes``
    of keys and values each."""
    usable = free - (1 - spec.gpu_memory_fraction) * total
    activations = chunk_tokens * (config.intermediate_size + 4 * config.hidden_size) * dtype_bytes
    logits = spec.max_batch * config.vocab_size * 4 * 2
    return max(int((usable - 4 * activations - logits) // token_bytes), 0)


def engine_threads(spec: ModelSpec, device_type: str, available: int) -> int:
    """OpenMP threads for the engine's steps on a CPU, where ``available`` is
    torch's count (its cores, or ``OMP_NUM_THREADS``): every core but one
    unless ``cpu_threads`` says otherwise. On 2 cores the service's web,
    database and job threads took the second core from a two-thread step,
    whose parallel regions then waited for it: one thread served 27.6 tokens/s
    at one stream against 20.1, and 126.4 against 90.4 at eight
    (bench/README.md). 0 on a GPU, whose threads only launch kernels."""
    if device_type != "cpu":
        return 0
    return spec.cpu_threads or max(1, available - 1)


def product_threads(spec: ModelSpec, device_type: str, available: int) -> int:
    """OpenMP threads for the engine's products of several rows on a CPU
    (``engine.linear``): every core, the one left to the rest of the service
    too, unless ``cpu_threads`` says otherwise; 0 on a GPU."""
    if device_type != "cpu":
        return 0
    return spec.cpu_threads or available


def linear_layers(layout: str) -> str:
    """How the load log names the model's linear layers."""
    from engine.linear import one_row_transposed

    if layout == "auto":
        return "packed and transposed" if one_row_transposed() else "packed (one row too)"
    return {"packed": "packed", "torch": "torch's"}[layout]


@functools.cache
def load_model(spec: ModelSpec) -> LoadedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.decoder import Decoder, kv_bytes_per_token, unsupported
    from engine.linear import can_pack

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device
    )
    if spec.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, spec.dtype)
    packable = can_pack(device, dtype)
    # Refused before the weights are read.
    if spec.linear == "packed" and not packable:
        raise ValueError(f'{spec.id}: linear = "packed" needs float32 on a CPU with oneDNN.')
    reason = unsupported(AutoConfig.from_pretrained(weights_folder(spec)))
    if reason is not None:
        raise ValueError(f"{spec.id}: the engine cannot run this model: {reason}.")
    layout = spec.linear if spec.linear != "auto" or packable else "torch"
    model = AutoModelForCausalLM.from_pretrained(
        weights_folder(spec), dtype=dtype, attn_implementation=spec.attention
    ).to(device)
    model.eval()
    with torch.no_grad():
        decoder = Decoder(model, layout, spec.attention)
    chunk_tokens = spec.prefill_chunk_tokens or CHUNK_TOKENS[device.type]
    budget = spec.kv_budget_tokens
    if not budget and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = derived_budget(
            spec,
            model.config,
            kv_bytes_per_token(model.config, dtype.itemsize),
            dtype.itemsize,
            free,
            total,
            chunk_tokens,
        )
        if budget < spec.context_window:
            log.warning(
                "%s: %d tokens of keys and values fit on %s, under its context window (%d): "
                "a request that outgrows them fails",
                spec.id, budget, device, spec.context_window,
            )  # fmt: skip
    elif not budget:
        budget = CPU_BUDGET_CONTEXTS * spec.context_window
    available = torch.get_num_threads()
    threads = engine_threads(spec, device.type, available)
    products = product_threads(spec, device.type, available)
    log.info(
        "Loaded %s on %s (%s, %s attention%s, %s linear layers, %s): %d tokens of keys and "
        "values, prompts in chunks of %d",
        spec.id, device, dtype, spec.attention,
        " (decoding rows: engine.decode_attention)" if decoder.attends_by_length else "",
        linear_layers(layout),
        f"{threads} engine threads, {products} for products of several rows"
        if threads else "torch's threads", budget, chunk_tokens,
    )  # fmt: skip
    return LoadedModel(
        spec, model, decoder, load_tokenizer(spec), budget, chunk_tokens, threads, products
    )
