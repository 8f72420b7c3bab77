"""Incremental detokenizing: the text of a growing list of token ids, piece
by piece, without decoding the whole output again on each step.

Why here: whatever engine generated the tokens (this package's own, or one
behind another server that streams token ids), the worker turns them into
text the same way; a piece ends only where its UTF-8 is complete.
``IncrementalDetokenizer`` holds back an incomplete UTF-8 sequence until its
last byte arrives.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


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
