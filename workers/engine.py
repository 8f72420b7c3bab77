"""Sampling settings, incremental detokenizing, and one sequence through
``model.generate``.

The worker generates through the batching engine (``batching``);
``generate`` is the plain one-sequence path it must agree with, token for
token: the tests and benchmarks compare the two. It drives
``model.generate`` and calls ``on_token`` after every decoding step; the
hook returns True to stop.
``IncrementalDetokenizer`` turns token ids into text pieces without
re-decoding the whole output on each step, holding back an incomplete
UTF-8 sequence until its last byte arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from .loading import LoadedModel


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float  # 0 means greedy


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
    sampling: Sampling,
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
            max_new_tokens=sampling.max_new_tokens,
            stopping_criteria=StoppingCriteriaList([_StepHook(on_token)]),
            logits_processor=LogitsProcessorList(list(logits_processors)),
            eos_token_id=eos,
            pad_token_id=eos[0],
            **options,
        )


class IncrementalDetokenizer:
    """Text of a growing token list, piece by piece (the vLLM/TGI offsets scheme).

    Only the last few tokens are decoded each step: ``prefix`` .. ``read``
    were already turned into text, and decoding from ``prefix`` gives the
    tokenizer enough context to place spaces right.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prefix: int = 0, read: int = 0) -> None:
        self.tokenizer = tokenizer
        self.prefix = prefix
        self.read = read

    def _decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )

    def step(self, token_ids: Sequence[int]) -> str:
        before = self._decode(token_ids[self.prefix : self.read])
        after = self._decode(token_ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(token_ids)
        return after[len(before) :]

    def rest(self, token_ids: Sequence[int]) -> str:
        """Whatever is still held back once generation has ended."""
        before = self._decode(token_ids[self.prefix : self.read])
        after = self._decode(token_ids[self.prefix :])
        self.prefix = self.read = len(token_ids)
        return after[len(before) :] if len(after) > len(before) else ""

    def offsets(self) -> dict[str, int]:
        return {"prefix": self.prefix, "read": self.read}
