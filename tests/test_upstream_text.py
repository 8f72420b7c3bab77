"""A server asked in text (``engine = "openai"``): its answer, streamed as
pieces of text, cut into the model's token ids (``engine.upstream``).

The ids given out must spell the answer exactly, whatever the cuts between
the pieces, and be the ids the tokenizer gives the whole answer, so that
usage counts what the model generated. The model's real tokenizer; no server
is needed (tests/test_upstream_e2e.py asks a real vLLM in text).
"""

from __future__ import annotations

import random

import pytest

from engine.interface import FinishReason
from engine.upstream import _TextTokens
from generation.registry import get_model
from workers.loading import load_tokenizer
from workers.upstream import TokenizerText

pytestmark = pytest.mark.model

ANSWERS = [
    "Once upon a time, in a small lighthouse by the sea, there lived an old keeper.\n\n"
    "Every night he climbed the 132 steps: café, naïve, 日本語のテキストには空白がありません。",
    "  two  spaces\tand tabs\n\n\nnewlines",
    "def f(x):\n    return x**2  # squared\n\n\tprint(f(3))",
    "1234567 + 89 = 1234656, ok?! Yes... (maybe) [x] {y}",
    "長い文章には空白がなくても、トークンは少しずつ出てきます。" * 3,
]


@pytest.fixture(scope="module")
def codec() -> TokenizerText:
    tokenizer = load_tokenizer(get_model("smollm2:135m"))
    return TokenizerText(tokenizer, int(tokenizer.eos_token_id))


def pieces_of(answer: str, seed: int) -> list[str]:
    """The answer cut as a server might stream it: a few characters at a time."""
    pieces, rng, start = [], random.Random(seed), 0
    while start < len(answer):
        end = min(len(answer), start + rng.randint(1, 7))
        pieces.append(answer[start:end])
        start = end
    return pieces


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("seed", range(3))
def test_pieces_of_text_become_the_ids_of_the_whole_answer(
    codec: TokenizerText, answer: str, seed: int
):
    tokens = _TextTokens(codec, max_tokens=4096)
    ids = [token for piece in pieces_of(answer, seed) for token in tokens.take(piece, None)]
    given_before_the_end = len(ids)
    ids += tokens.take("", FinishReason.EOS)
    assert ids == [*codec.encode(answer), codec.eos_token_id]
    assert codec.decode(ids[:-1]) == answer
    # ... and given out as the answer comes: only its last word waits for the end
    spelled = codec.decode(ids[:given_before_the_end])
    assert answer.startswith(spelled) and len(answer[len(spelled) :].split()) <= 1


@pytest.mark.parametrize("answer", ANSWERS)
def test_nothing_is_given_out_past_max_tokens_as_counted_here(codec: TokenizerText, answer: str):
    tokens = _TextTokens(codec, max_tokens=10)
    ids = [token for piece in pieces_of(answer, 0) for token in tokens.take(piece, None)]
    ids += tokens.take("", FinishReason.LENGTH)
    assert ids == codec.encode(answer)[:10] and tokens.full
