"""Many users at once: the service's batched worker beside raw transformers.

    .venv/bin/python bench/bench_concurrency.py                 # the verdict run: 3 rounds
    .venv/bin/python bench/bench_concurrency.py --alone         # the c=1 targets only
    .venv/bin/python bench/bench_concurrency.py --tokens 16 --rounds 3 --pairs 3   # a smoke run

One run prints, side by side:

- raw single: ``model.generate`` of one sequence in this process;
- raw batch of 8: one ``model.generate`` of 8 left-padded copies of the prompt;
- service c=N: the service as the Procfile runs it (``bench/service.py``:
  honcho with its web processes, the model worker and the ops worker, the
  shipped settings unless the environment sets them), N streamed
  ``POST /responses`` at once;
- late joiner: one request sent while 7 others decode.

Every request is greedy with the same prompt and the same
``max_output_tokens``; the answer may end before it, so tokens are counted
from what each answer used. The service runs with its prefix cache off
(``prefix_cache = false``): raw transformers computes every prompt, and
with the cache on every request after the first took the prompt from it
(the first token's overhead then read -38 ms, a comparison of unequal
work). A round runs every variant once, the raw side first in odd rounds
and the service first in even ones (``in_turn``), so that neither side
always runs on a machine warmed, or loaded, by the other. The first
token's overhead is measured apart, after the rounds: ``--pairs`` pairs of
a raw prefill (``generate`` of one token) and a service request of 4
tokens, their order alternated too; each pair is a round of that target.

The targets (issue 10), fixed before measuring; each is judged on the
median of the rounds' figures (``bench/verdict.py``), the best round beside
it for information only:

- service c=8 / service c=1 tokens/s >= 4, and / raw batch of 8 >= 0.85;
- service c=1 / raw single tokens/s >= 0.97;
- first token over raw prefill (service TTFT minus the raw prefill of the
  same pair) <= 15 ms;
- late joiner: its TTFT within 2x the round's service c=1 TTFT plus one
  decoding step of the round's raw batch of 8 (its median step: the
  baseline's step, not the service's), i.e. late / limit <= 1.

The throughput and late-joiner targets hold for 128 output tokens per
request: other ``--tokens`` print the figures and no verdict for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from service import procfile_service, smollm2_models_file, task_body  # noqa: E402
from verdict import Target, verdicts  # noqa: E402

PROMPT = "Write a long, detailed story about a lighthouse keeper."
TOKENS = 128  # the targets' output tokens per request
AT_TOKENS = {"tokens": TOKENS}
TARGETS = [
    Target("service c=8 / service c=1", 4.0, at_most=False, unit="x", conditions=AT_TOKENS),
    Target("service c=8 / raw batch of 8", 0.85, at_most=False, unit="x", conditions=AT_TOKENS),
    Target("service c=1 / raw single", 0.97, at_most=False, unit="x", conditions=AT_TOKENS),
    Target("first token over raw prefill", 15.0, at_most=True, unit=" ms", fmt=".1f"),
    Target("late joiner / its limit", 1.0, at_most=True, unit="x", conditions=AT_TOKENS),
]


A = TypeVar("A")
B = TypeVar("B")


def in_turn(raw_first: bool, raw: Callable[[], A], service: Callable[[], B]) -> tuple[A, B]:
    """Both sides of a comparison, the raw one first or second as told."""
    if raw_first:
        first = raw()
        return first, service()
    second = service()
    return raw(), second


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


class Round:
    """One variant's figures in one round: tokens/s and per-stream latencies
    in seconds; ``steps``: raw generation's decoding steps (between
    consecutive tokens)."""

    def __init__(
        self, tokens: int, seconds: float, ttft: list[float], itl: list[float], steps: list[float]
    ) -> None:
        self.tokens_per_s = tokens / seconds
        self.ttft, self.itl, self.steps = ttft, itl, steps


# --- raw transformers ------------------------------------------------------------------


def raw_generate(lm, prompt_ids: list[int], copies: int, tokens: int) -> Round:  # noqa: ANN001
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    steps: list[float] = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:  # noqa: ANN001, ANN003
            steps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor([prompt_ids] * copies, device=lm.model.device)
    eos = sorted(lm.eos_token_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        lm.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=eos[0],
            stopping_criteria=StoppingCriteriaList([Clock()]),
        )
    seconds = time.perf_counter() - start
    itl = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return Round(tokens * copies, seconds, [steps[0] - start], itl, itl)


# --- the service -------------------------------------------------------------------------


async def one_stream(
    client,
    token: str,
    tokens: int,
    started: asyncio.Event | None = None,  # noqa: ANN001
) -> tuple[float, list[float], int]:
    """(TTFT, delta arrival times, output tokens) of one streamed request;
    ``started`` is set at its first text delta."""
    body = task_body(PROMPT, tokens, temperature=0, stream=True)["request"]
    sent = time.perf_counter()
    arrivals: list[float] = []
    used = 0
    headers = {"Authorization": f"Bearer {token}"}
    async with client.stream("POST", "/lmsp/v1/responses", json=body, headers=headers) as answer:
        async for line in answer.aiter_lines():
            if line.startswith("event: response.output_text.delta"):
                arrivals.append(time.perf_counter())
                if started is not None:
                    started.set()
            elif line.startswith("data: ") and '"usage"' in line:
                used = json.loads(line[6:])["usage"]["output_tokens"]
    return arrivals[0] - sent, arrivals, used


async def service_round(base: str, token: str, concurrency: int, tokens: int) -> Round:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=None) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, token, tokens) for _ in range(concurrency))
        )
        seconds = time.perf_counter() - start
    itl = [
        b - a for _, arrivals, _ in results for a, b in zip(arrivals, arrivals[1:], strict=False)
    ]
    steps = [(arrivals[-1] - arrivals[0]) / (used - 1) for _, arrivals, used in results if used > 1]
    return Round(sum(r[2] for r in results), seconds, [r[0] for r in results], itl, steps)


async def late_joiner(base: str, token: str, tokens: int) -> float:
    """TTFT of one request sent once 7 others are decoding."""
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=None) as client:
        started = [asyncio.Event() for _ in range(7)]
        others = [asyncio.create_task(one_stream(client, token, tokens, e)) for e in started]
        for event in started:
            await event.wait()  # all seven are decoding
        ttft, _, _ = await one_stream(client, token, 16)
        await asyncio.gather(*others)
    return ttft


def prompt_ids_of(lm) -> list[int]:  # noqa: ANN001
    from generation.params import GenerationParams
    from generation.prompts import render_prompt
    from generation.tokens import prompt_tokenizer

    message = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": PROMPT}],
    }
    prompt = render_prompt(lm.spec, prompt_tokenizer(lm.spec), [message], GenerationParams())
    return lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--alone", action="store_true", help="raw single and service c=1 only")
    parser.add_argument("--pairs", type=int, default=20, help="raw prefill / service TTFT pairs")
    args = parser.parse_args()

    variants: dict[str, list[Round]] = {}
    figures: dict[str, list[float]] = {}

    def measure(name: str, result: Round) -> Round:
        variants.setdefault(name, []).append(result)
        return result

    def record(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    registry = Path(tempfile.mkdtemp()) / "models.toml"
    registry.write_text(smollm2_models_file({"smollm2:135m": "prefix_cache = false"}))
    with procfile_service(LMSP_MODELS_FILE=str(registry)) as service:
        from generation.registry import get_model
        from workers.loading import load_model

        token = service.token("bench", ["responses:write"])
        base = service.base_url
        lm = load_model(get_model("smollm2:135m"))
        prompt_ids = prompt_ids_of(lm)
        raw_generate(lm, prompt_ids, 1, 8)  # warm-up
        asyncio.run(service_round(base, token, 1, 4))

        for number in range(1, args.rounds + 1):
            raw_first = number % 2 == 1
            raw1, s1 = in_turn(
                raw_first,
                lambda: measure("raw single", raw_generate(lm, prompt_ids, 1, args.tokens)),
                lambda: measure(
                    "service c=1", asyncio.run(service_round(base, token, 1, args.tokens))
                ),
            )
            record("service c=1 / raw single", s1.tokens_per_s / raw1.tokens_per_s)
            if args.alone:
                continue
            raw8, by_c = in_turn(
                raw_first,
                lambda: measure("raw batch of 8", raw_generate(lm, prompt_ids, 8, args.tokens)),
                lambda: {
                    c: measure(
                        f"service c={c}", asyncio.run(service_round(base, token, c, args.tokens))
                    )
                    for c in (4, 8, 16)
                },
            )
            s8_round = by_c[8]
            record("service c=8 / service c=1", s8_round.tokens_per_s / s1.tokens_per_s)
            record("service c=8 / raw batch of 8", s8_round.tokens_per_s / raw8.tokens_per_s)
            late = asyncio.run(late_joiner(base, token, args.tokens))
            limit = 2 * pct(s1.ttft, 0.5) + pct(raw8.steps, 0.5)
            record("late joiner / its limit", late / limit)
            print(
                f"round {number}: late joiner {late * 1e3:.1f} ms, its limit 2 x service c=1 "
                f"TTFT {pct(s1.ttft, 0.5) * 1e3:.1f} + raw batch step "
                f"{pct(raw8.steps, 0.5) * 1e3:.1f} = {limit * 1e3:.1f} ms",
                flush=True,
            )
        for pair in range(args.pairs):
            prefill, first = in_turn(
                pair % 2 == 0,
                lambda: raw_generate(lm, prompt_ids, 1, 1).ttft[0],
                lambda: asyncio.run(service_round(base, token, 1, 4)).ttft[0],
            )
            record("first token over raw prefill", (first - prefill) * 1e3)

    print(f"{args.tokens} output tokens per request, greedy, {args.rounds} rounds; ms")
    print(
        f"{'variant':<16}{'tok/s med':>10}{'tok/s best':>11}{'TTFT p50':>10}{'TTFT p95':>10}"
        f"{'ITL p50':>9}{'ITL p95':>9}   (medians of the rounds; best for information)"
    )
    for name, rounds in variants.items():

        def median(figure, rounds=rounds) -> float:  # noqa: ANN001
            return statistics.median(figure(r) for r in rounds)

        print(
            f"{name:<16}{median(lambda r: r.tokens_per_s):>10.1f}"
            f"{max(r.tokens_per_s for r in rounds):>11.1f}"
            f"{median(lambda r: pct(r.ttft, 0.5)) * 1e3:>10.0f}"
            f"{median(lambda r: pct(r.ttft, 0.95)) * 1e3:>10.0f}"
            f"{median(lambda r: pct(r.itl, 0.5)) * 1e3:>9.1f}"
            f"{median(lambda r: pct(r.itl, 0.95)) * 1e3:>9.1f}"
        )
    targets = TARGETS
    if args.alone:
        alone = {"service c=1 / raw single", "first token over raw prefill"}
        targets = [target for target in TARGETS if target.name in alone]
    print()
    for line in verdicts(targets, figures, {"tokens": args.tokens}):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
