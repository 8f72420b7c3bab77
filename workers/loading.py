"""Loading a model onto the device, and its transformers tokenizer: each once per process."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from generation.registry import ModelSpec
from generation.weights import weights_folder

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: object  # transformers PreTrainedModel
    tokenizer: object  # transformers PreTrainedTokenizerBase

    @functools.cached_property
    def eos_token_ids(self) -> set[int]:
        """The model's end tokens and the tokenizer's (without touching either's config)."""
        ids = self.model.generation_config.eos_token_id
        ids = list(ids) if isinstance(ids, list) else [ids]
        ids.append(self.tokenizer.eos_token_id)
        return {i for i in ids if i is not None}


@functools.cache
def load_tokenizer(spec: ModelSpec) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(weights_folder(spec))


@functools.cache
def load_model(spec: ModelSpec) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM

    folder = weights_folder(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    model.eval()
    log.info("Loaded %s on %s", spec.id, device)
    return LoadedModel(spec=spec, model=model, tokenizer=load_tokenizer(spec))
