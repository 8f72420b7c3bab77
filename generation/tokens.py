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
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .registry import ModelSpec
from .weights import weights_folder

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


@dataclass(frozen=True)
class PromptTokenizer:
    tokenizer: Tokenizer
    chat_template: str
    special_tokens: dict[str, str]

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

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


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
    return PromptTokenizer(
        tokenizer=Tokenizer.from_file(str(folder / "tokenizer.json")),
        chat_template=template,
        special_tokens={name: text for name, text in special.items() if text is not None},
    )
