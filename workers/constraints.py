"""Constrained decoding (grammars for tool calls and JSON schemas).

Plain text requests need no constraint: no logits processor, and the model
alone decides when it has finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from .loading import LoadedModel


def logits_processors(lm: LoadedModel, params: dict, generated: Sequence[int]) -> list[object]:
    return []


def ended(lm: LoadedModel, generated: Sequence[int]) -> bool:
    """Whether a grammar has reached its end (the answer is complete)."""
    return False
