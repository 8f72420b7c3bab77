"""Time per output token, grammar-constrained versus free, through the engine.

    .venv/bin/python bench/bench_constrained.py                  # the verdict run: 5 rounds
    .venv/bin/python bench/bench_constrained.py --rounds 3 --model qwen3:0.6b

Both variants go through the batching engine the worker decodes with
(``engine.client.engine_for(...).submit``), one request at a time, from
the same prompt, greedily, and generate the same number of tokens: the
constrained answer's length, its end token included (the free variant is
submitted without end tokens, so it runs to that length). They differ only
in the grammar the engine applies. The constrained variant pays the grammar
compilation each round (the worker's cache cleared), as a request with a
schema the worker has not seen before does: in a child process with a time
and memory limit (``generation/grammar_limits.py``). Its time per token is
from the compile's start to the last token; the compile alone is printed
beside it.

Rounds alternate the variants, so a change in the machine's speed hits
both. The target (issue 4), fixed before measuring: constrained / free time
per token <= 1.15, judged on the median of the rounds' ratios (each round's
constrained over the same round's free), the best round beside it for
information (``bench/verdict.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run

from verdict import Target, verdicts  # noqa: E402

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
RATIO = "constrained / free time per token"
TARGETS = [Target(RATIO, 1.15, at_most=True, unit="x")]


def timed(engine, prompt_ids: list[int], tokens: int, grammar, eos) -> tuple[float, list[int]]:  # noqa: ANN001
    """Seconds from submit to the request's end, and the tokens it generated."""
    from engine.interface import SamplingParams

    started = time.perf_counter()
    generation = engine.add_request(
        prompt_ids,
        SamplingParams(max_tokens=tokens, temperature=0),
        grammar=grammar,
        eos_token_ids=eos,
    )
    generated = list(generation.stream())
    generation.wait()
    return time.perf_counter() - started, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import django

    django.setup()
    from engine.client import engine_for
    from generation import prompts
    from generation.params import GenerationParams
    from generation.registry import get_model
    from generation.tokens import prompt_tokenizer
    from workers import constraints
    from workers.loading import load_model

    spec = get_model(args.model)
    lm = load_model(spec)
    engine = engine_for(lm, spec.max_batch)
    params = GenerationParams(
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    )
    user = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": QUESTION}],
    }
    prompt = prompts.render_prompt(spec, prompt_tokenizer(spec), [user], params)
    prompt_ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    # The constrained answer's length, found once (greedy: every round repeats it).
    _, answer = timed(engine, prompt_ids, 1024, constraints.compiled_grammar(lm, params), None)
    tokens = len(answer)
    text = lm.tokenizer.decode([t for t in answer if t not in lm.eos_token_ids])
    print(
        f"model {args.model} on {lm.model.device}, prompt {len(prompt_ids)} tokens, "
        f"answer {tokens} tokens (end token included):\n{text}\n"
    )
    timed(engine, prompt_ids, tokens, None, ())  # warm-up of the free path

    free, constrained, compiles, ratios = [], [], [], []
    for number in range(1, args.rounds + 1):
        seconds, generated = timed(engine, prompt_ids, tokens, None, ())
        assert len(generated) == tokens
        free.append(seconds / tokens * 1000)
        constraints.clear_compiled()  # a schema the worker has not seen
        started = time.perf_counter()
        grammar = constraints.compiled_grammar(lm, params)
        compiled = time.perf_counter() - started
        seconds, generated = timed(engine, prompt_ids, tokens, grammar, None)
        assert generated == answer, "the constrained answer changed"
        constrained.append((compiled + seconds) / tokens * 1000)
        compiles.append(compiled * 1000)
        ratios.append(constrained[-1] / free[-1])
        print(
            f"round {number}: free {free[-1]:.2f} ms/token, constrained {constrained[-1]:.2f} "
            f"ms/token (compile {compiles[-1]:.0f} ms), ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print()
    print(
        f"medians of {args.rounds} rounds: free {statistics.median(free):.2f} ms/token, "
        f"constrained {statistics.median(constrained):.2f} ms/token, "
        f"compile {statistics.median(compiles):.0f} ms"
    )
    for line in verdicts(TARGETS, {RATIO: ratios}, {}):
        print(line)


if __name__ == "__main__":
    main()
