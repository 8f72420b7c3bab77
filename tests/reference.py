"""The reference path: one sequence through transformers' own
``model.generate``, which the engine's answers must equal token for token
(``tests/test_batching.py``, ``bench/greedy_parity.py``).

Why in tests: the service never generates this way; the engine replaced it.
It stays as the yardstick the tests and benchmarks measure the engine
against. ``generate`` calls ``on_token`` after every decoding step; the hook
returns True to stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from engine.interface import SamplingParams
from workers.loading import LoadedModel


class _StepHook(StoppingCriteria):  # type: ignore[misc]  # transformers is read as Any
    def __init__(self, on_token: Callable[[int], bool]) -> None:
        self.on_token = on_token

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        stop = self.on_token(int(input_ids[0, -1]))
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def generate(
    lm: LoadedModel,
    input_ids: Sequence[int],
    sampling: SamplingParams,
    on_token: Callable[[int], bool],
    logits_processors: Sequence[object] = (),
) -> None:
    ids = torch.tensor([list(input_ids)], device=lm.model.device)
    options: dict[str, Any] = {"do_sample": sampling.temperature > 0}
    if options["do_sample"]:
        options.update(temperature=sampling.temperature, top_k=0, top_p=1.0)
    eos = sorted(lm.eos_token_ids)
    with torch.inference_mode():
        lm.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=sampling.max_tokens,
            stopping_criteria=StoppingCriteriaList([_StepHook(on_token)]),
            logits_processor=LogitsProcessorList(list(logits_processors)),
            eos_token_id=eos,
            pad_token_id=eos[0],
            **options,
        )
