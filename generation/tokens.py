"""The tokenizer as the web process needs it: a prompt rendered with the
model's chat template, and its length in tokens, without torch.

transformers 5 imports torch as soon as ``AutoTokenizer`` is imported, and a
web process would carry it (about 300 MiB) for two small jobs. This reads
the files the worker's tokenizer loads (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) with the ``tokenizers``
library and renders the template with transformers' own renderer
(``render_jinja_template``, which imports no torch), so the web and the
worker see the same text and the same ids (``tests/test_constraints.py``
checks both against ``AutoTokenizer``; ``tests/test_layers.py`` that no
torch is imported).

Counting a prompt is bounded by the model's context, not by the request:
the tokenizer holds the GIL while it encodes one text (a megabyte took
seconds, stalling every other request of the process), so a prompt is
encoded in pieces through ``encode_batch``, which lets the GIL go, and the
counting stops once the pieces pass the limit. A prompt longer in
characters than the limit times the longest token cannot fit at all and is
not encoded.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .registry import ModelSpec, available_models
from .weights import is_ready, weights_folder

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: what a
# chat template sees beside the messages.
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


# Prompts are encoded in pieces of about this many characters, each cut just
# before a space that follows a non-space character: no pre-token of a
# byte-level BPE tokenizer (GPT-2's, Llama 3's and Qwen's split patterns) nor
# of a SentencePiece one spans such a cut, so the pieces' counts add up to
# the whole's (tests/test_constraints.py). Text with no such space for a
# whole piece (one long word, CJK) is cut anywhere: the count then changes
# near each cut by a few tokens, so it stops early only at twice the limit,
# and a text that ends below that is counted again whole.
PIECE_CHARS = 32_768
_CUT = re.compile(r"(?<=\S) ")
_INEXACT_MARGIN = 2


@dataclass(frozen=True)
class PromptTokenizer:
    tokenizer: Tokenizer
    chat_template: str
    special_tokens: dict[str, str]
    longest_token: int  # characters, at most, that one token stands for

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt for ``messages``, ending where the assistant's answer starts."""
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            **self.special_tokens,
        )
        text: str = rendered[0]
        return text

    def count(self, text: str, limit: int | None = None) -> int:
        """The tokens of ``text``; with ``limit``, a number above it as soon
        as the text is known to have more (the exact count when it has not)."""
        if limit is None:
            return self._encoded(text)
        if len(text) > (limit + 1) * self.longest_token:
            return limit + 1  # more characters than limit + 1 tokens can hold
        total, start, exact = 0, 0, True
        while start < len(text):
            end = start + PIECE_CHARS
            if end < len(text):
                cut = _CUT.search(text, end, end + PIECE_CHARS)
                exact = exact and cut is not None
                end = cut.start() if cut is not None else end
            total += self._encoded(text[start:end])
            if total > (limit if exact else _INEXACT_MARGIN * limit):
                return total
            start = end
        return total if exact else self._encoded(text)

    def _encoded(self, text: str) -> int:
        """Tokens of ``text``, counted without the GIL (``encode_batch``;
        ``encode`` holds it while it works)."""
        [encoding] = self.tokenizer.encode_batch([text], add_special_tokens=False)
        return len(encoding.ids)


def import_renderer() -> None:
    """Import transformers' template renderer now: the import takes a second
    or more, which the first request to render a prompt would otherwise wait
    for (the web process calls this at start, ``lmsp_project/asgi.py``)."""
    from transformers.utils import chat_template_utils  # noqa: F401


def load_ready_tokenizers() -> None:
    """Load now the prompt tokenizers of the models whose files are ready: the
    first request of each web process would otherwise load them (115 ms for
    SmolLM2's on an idle core; in a burst of 8 streams, the 4 requests that
    reached a web process that had served none waited 0.6-0.9 s longer than
    the others while the engine decoded beside them). A model still to be
    converted is left to its first request (the web process calls this at
    start, ``lmsp_project/asgi.py``)."""
    for spec in available_models().values():
        if is_ready(spec):
            prompt_tokenizer(spec)


def _token_text(value: object) -> str | None:
    # tokenizer_config.json holds a token as its text or as {"content": text, ...}.
    text = value.get("content") if isinstance(value, dict) else value
    return text if isinstance(text, str) else None


@functools.cache
def prompt_tokenizer(spec: ModelSpec) -> PromptTokenizer:
    from tokenizers import Tokenizer

    folder = Path(weights_folder(spec))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else config["chat_template"]
    special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return PromptTokenizer(
        tokenizer=tokenizer,
        chat_template=template,
        special_tokens={name: text for name, text in special.items() if text is not None},
        # A token's text in the vocabulary has a symbol per byte (byte-level
        # BPE) or per character: never fewer symbols than characters.
        longest_token=max(map(len, tokenizer.get_vocab(with_added_tokens=True))),
    )
