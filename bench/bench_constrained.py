"""Time per output token, grammar-constrained versus free, on the same prompt.

    .venv/bin/python bench/bench_constrained.py [--model smollm2:135m] [--rounds 3]

Both variants generate exactly the same number of tokens from the same
prompt, greedily, through the same ``model.generate`` call; they differ only
in the grammar's logits processor. The constrained variant pays the grammar
compilation each round (the compiler's caches are cleared), as a request
with a schema the worker has not seen before does. Rounds alternate between
the two variants so that a change in machine load hits both alike; on a
shared machine the fastest round of each variant is the least disturbed one,
so the ratio is given from the best rounds as well as from the medians.
The time spent compiling and masking is also measured directly (the logits
processor's own time), which machine load hardly blurs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

import django  # noqa: E402

django.setup()

import torch  # noqa: E402

from generation import prompts  # noqa: E402
from generation.params import GenerationParams  # noqa: E402
from generation.registry import get_model  # noqa: E402
from generation.tokens import prompt_tokenizer  # noqa: E402
from workers import constraints  # noqa: E402
from workers.loading import LoadedModel, load_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "country": {"type": "string", "maxLength": 30},
                    "population": {"type": "integer", "minimum": 0},
                },
                "required": ["name", "country", "population"],
            },
            "minItems": 5,
            "maxItems": 5,
        }
    },
    "required": ["cities"],
}
QUESTION = "List five big cities with their country and population."


class Timed:
    """Wraps a logits processor and adds up the time spent in it."""

    def __init__(self, processor: object) -> None:
        self.processor = processor
        self.seconds = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        started = time.perf_counter()
        scores = self.processor(input_ids, scores)
        self.seconds += time.perf_counter() - started
        return scores


def generate(
    lm: LoadedModel, prompt_ids: list[int], tokens: int, params: GenerationParams | None
) -> tuple[float, float]:
    """Seconds to generate exactly ``tokens`` tokens (constrained when ``params`` is given),
    and the seconds of that spent compiling the grammar and masking."""
    started = time.perf_counter()
    processors = [Timed(p) for p in constraints.logits_processors(lm, params, [])] if params else []
    compiled = time.perf_counter() - started
    ids = torch.tensor([prompt_ids], device=lm.model.device)
    eos = sorted(lm.eos_token_ids)
    with torch.inference_mode():
        out = lm.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=tokens,
            # Both variants carry the same length processor: the free one
            # must not stop early, and the grammar never allows an end there.
            min_new_tokens=tokens,
            logits_processor=processors,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    elapsed = time.perf_counter() - started
    assert out.shape[1] - len(prompt_ids) == tokens
    return elapsed, compiled + sum(p.seconds for p in processors)


def clear_grammar_caches(lm: LoadedModel) -> None:
    constraints.clear_compiled()  # compiles run in a fresh child each time: no other cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)

    lm = load_model(get_model(args.model))
    params = GenerationParams(
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    )
    user = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": QUESTION}],
    }
    prompt = prompts.render_prompt(lm.spec, prompt_tokenizer(lm.spec), [user], params)
    prompt_ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    # The constrained answer's length, found once (greedy, so every round repeats it).
    processors = constraints.logits_processors(lm, params, [])
    ids = torch.tensor([prompt_ids], device=lm.model.device)
    with torch.inference_mode():
        out = lm.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=1024,
            logits_processor=processors,
            eos_token_id=sorted(lm.eos_token_ids),
            pad_token_id=sorted(lm.eos_token_ids)[0],
        )
    answer = [t for t in out[0, len(prompt_ids) :].tolist() if t not in lm.eos_token_ids]
    tokens = len(answer)
    print(
        f"model {args.model} on {lm.model.device}, prompt {len(prompt_ids)} tokens, "
        f"answer {tokens} tokens:\n{lm.tokenizer.decode(answer)}\n"
    )

    free, constrained, grammar = [], [], []
    for round_ in range(1, args.rounds + 1):
        seconds, _ = generate(lm, prompt_ids, tokens, None)
        free.append(seconds / tokens * 1000)
        clear_grammar_caches(lm)
        seconds, in_grammar = generate(lm, prompt_ids, tokens, params)
        constrained.append(seconds / tokens * 1000)
        grammar.append(in_grammar / tokens * 1000)
        print(
            f"round {round_}: unconstrained {free[-1]:.1f} ms/token, "
            f"constrained {constrained[-1]:.1f} ms/token "
            f"(of which compiling and masking {grammar[-1]:.2f})"
        )

    def show(label: str, free_ms: float, constrained_ms: float) -> None:
        ratio = constrained_ms / free_ms
        print(
            f"{label}: unconstrained {free_ms:.2f} ms/token, constrained {constrained_ms:.2f} "
            f"ms/token, ratio {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)"
        )

    print()
    show("median rounds", statistics.median(free), statistics.median(constrained))
    show("best rounds  ", min(free), min(constrained))
    added = statistics.median(grammar) / min(free)
    print(
        f"compiling + masking alone: {statistics.median(grammar):.2f} ms/token, "
        f"{added * 100:+.1f}% of the best unconstrained time per token"
    )
    print(
        f"ratio constrained/unconstrained: {min(constrained) / min(free):.3f} "
        "(best rounds; target <= 1.15)"
    )


if __name__ == "__main__":
    main()
