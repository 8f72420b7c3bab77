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
from concurrent.futures import ThreadPoolExecutor
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
    torch's count (its cores, or ``OMP_NUM_THREADS``): every core, as vLLM's
    CPU backend runs its model, unless ``cpu_threads`` says otherwise; 0 on a
    GPU, whose threads only launch kernels.

    Measured on a 2-core Xeon (AVX-512), the service generating with the
    model loaded apart (``load_model``): one stream 29.8-31.0 tokens/s on two
    threads against 21.0-21.6 on one, eight streams 128.3-136.5 against
    115.8-125.2. The threads keep OpenMP's default wait (they spin briefly
    between parallel regions, then sleep): with ``OMP_WAIT_POLICY=PASSIVE`` a
    step of one row took 48.5-49.4 ms on two threads, as on one, against
    29.9-32.5 ms."""
    if device_type != "cpu":
        return 0
    return spec.cpu_threads or available


def linear_layers(layout: str) -> str:
    """How the load log names the model's linear layers."""
    from engine.linear import blocked_rows

    if layout == "auto":
        rows = blocked_rows()
        return f"packed and in blocks (steps of up to {rows} rows)" if rows else "packed"
    return {"packed": "packed", "torch": "torch's"}[layout]


@functools.cache
def load_model(spec: ModelSpec) -> LoadedModel:
    """``spec``'s model, loaded on a thread of its own that ends with the load.

    Why: GNU OpenMP keeps a pool of threads for every thread that has run a
    parallel region, for as long as that thread lives, and once the process
    holds more of them than the machine has cores, every pool's threads
    spin only a moment before they sleep. Loaded on the worker's main
    thread (which packs the weights on every core), that pool stayed, and
    the engine thread's steps woke a sleeping thread for each product: one
    row took 46.5-49.1 ms on two threads, as on one, against 29.5-30.1 ms
    with no other pool (2-core Xeon). Ended with its thread, the loader's
    pool leaves the engine thread's alone."""
    with ThreadPoolExecutor(1, thread_name_prefix=f"load-{spec.id}") as loader:
        return loader.submit(_load, spec).result()


def _load(spec: ModelSpec) -> LoadedModel:
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
    log.info(
        "Loaded %s on %s (%s, %s attention%s, %s linear layers, %s): %d tokens of keys and "
        "values, prompts in chunks of %d",
        spec.id, device, dtype, spec.attention,
        " (decoding rows: engine.decode_attention)" if decoder.attends_by_length else "",
        linear_layers(layout),
        f"{threads} engine threads" if threads else "torch's threads", budget, chunk_tokens,
    )  # fmt: skip
    return LoadedModel(spec, model, decoder, load_tokenizer(spec), budget, chunk_tokens, threads)
