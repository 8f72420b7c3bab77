"""Many users at once: the service's batched worker beside raw transformers.

    .venv/bin/python bench/bench_concurrency.py [--tokens 128] [--rounds 2] [--alone]

One run prints, side by side:

- raw single: ``model.generate`` of one sequence in this process;
- raw batch of 8: one ``model.generate`` of 8 left-padded copies of the prompt;
- service c=N: the service started as ``scripts/serve`` starts it (embedded
  PostgreSQL and Redis unless DATABASE_URL / REDIS_URL are set, one web
  process, one model worker), N streamed ``POST /responses`` at once;
- late joiner: one request sent while 7 others decode, its time to first
  token beside the same request's alone (c=1) twice plus one decoding step
  of c=8 (a stream's first to last token over the tokens between: deltas
  written in one flush arrive together, so their gaps are no step).

``--alone`` runs only raw single and service c=1, for the c=1 targets
(throughput and first-token overhead against raw generation), with more
rounds in the same time; ``LMSP_FLUSH_INTERVAL_SECONDS`` and the other
settings in the environment reach the service.

The first token's overhead is measured apart, after the rounds: ``--pairs``
(20) alternations of a raw prefill (``generate`` of one token) and a
service request of 4 tokens, one at a time; it prints the median and the
best of each, the difference of the medians, and the median of each pair's
difference (a slow drift of the machine's speed, which moves both of a
pair, moves this one less; one request per round in the rounds above is
too few for a figure of a few milliseconds).

For each: aggregate output tokens/s (all streams), time to first token
(p50/p95, from sending the request to the first text delta; for raw
generation, the prefill) and inter-token time (p50/p95, between deltas of a
stream). Every request is greedy with the same prompt and the same
``max_output_tokens``; the answer may end before it, so tokens are counted
from what each answer used. Variants alternate round by round, and the
best round of each is printed beside the median (the machine is shared and
noisy; the best round is the least disturbed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

PROMPT = "Write a long, detailed story about a lighthouse keeper."
PORT = 8431


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


class Round:
    """One variant's figures: tokens/s and per-stream latencies in seconds;
    ``steps``: each stream's decoding step, its first to its last token
    over the tokens between (deltas written in one flush arrive together,
    so the gaps between deltas do not show a step)."""

    def __init__(
        self,
        tokens: int,
        seconds: float,
        ttft: list[float],
        itl: list[float],
        steps: list[float],
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
    body = {
        "model": "smollm2:135m",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}
        ],
        "max_output_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
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


def start_service(stack: ExitStack) -> tuple[str, str]:
    """Web and model worker as scripts/serve runs them; returns (base URL, token)."""
    from lmsp_project.devstack import services

    env = {**os.environ, **stack.enter_context(services())}
    os.environ.update(env)
    python = sys.executable
    subprocess.run([python, "manage.py", "migrate", "--no-input", "-v", "0"], cwd=ROOT, env=env)
    created = subprocess.run(
        [
            python,
            "manage.py",
            "lmsp_token",
            "create",
            "--user",
            "bench",
            "--scopes",
            "responses:write",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    token = created.stdout.strip().splitlines()[-1]
    logs = ROOT / "test-artifacts" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    for name, argv in (
        (
            "web",
            [
                "-m",
                "uvicorn",
                "lmsp_project.asgi:application",
                "--port",
                str(PORT),
                "--no-access-log",
            ],
        ),
        ("worker", ["-m", "workers.serve", "--loglevel", "WARNING"]),
    ):
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - the child keeps it
        process = subprocess.Popen([python, *argv], cwd=ROOT, env=env, stdout=log, stderr=log)
        stack.callback(process.wait, 30)
        stack.callback(process.terminate)
    return f"http://127.0.0.1:{PORT}", token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--alone", action="store_true", help="raw single and service c=1 only")
    parser.add_argument("--pairs", type=int, default=20, help="raw prefill / service TTFT pairs")
    args = parser.parse_args()

    with ExitStack() as stack:
        base, token = start_service(stack)
        import django

        django.setup()
        from generation.params import GenerationParams
        from generation.prompts import render_prompt
        from generation.registry import get_model
        from generation.tokens import prompt_tokenizer
        from workers.loading import load_model

        spec = get_model("smollm2:135m")
        lm = load_model(spec)
        message = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": PROMPT}],
        }
        prompt = render_prompt(spec, prompt_tokenizer(spec), [message], GenerationParams())
        prompt_ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]

        import httpx

        for _ in range(600):  # the worker loads the model, then answers
            try:
                asyncio.run(service_round(base, token, 1, 4))
                break
            except (httpx.HTTPError, IndexError):
                time.sleep(0.5)
        raw_generate(lm, prompt_ids, 1, 8)  # warm-up

        variants: dict[str, list[Round]] = {}
        for _ in range(args.rounds):
            variants.setdefault("raw single", []).append(
                raw_generate(lm, prompt_ids, 1, args.tokens)
            )
            for c in (1,) if args.alone else (1, 4, 8, 16):
                variants.setdefault(f"service c={c}", []).append(
                    asyncio.run(service_round(base, token, c, args.tokens))
                )
            if not args.alone:
                variants.setdefault("raw batch of 8", []).append(
                    raw_generate(lm, prompt_ids, 8, args.tokens)
                )
        late = [
            asyncio.run(late_joiner(base, token, args.tokens))
            for _ in range(0 if args.alone else args.rounds)
        ]
        prefills, firsts = [], []
        for _ in range(args.pairs):
            prefills.append(raw_generate(lm, prompt_ids, 1, 1).ttft[0])
            firsts.append(asyncio.run(service_round(base, token, 1, 4)).ttft[0])

    def best(name: str) -> Round:
        return max(variants[name], key=lambda r: r.tokens_per_s)

    def median_tps(name: str) -> float:
        return statistics.median(r.tokens_per_s for r in variants[name])

    print(f"{args.tokens} output tokens per request, greedy, {args.rounds} rounds; ms")
    print(
        f"{'variant':<16}{'tok/s best':>11}{'tok/s med':>10}{'vs c=1':>8}"
        f"{'TTFT p50':>10}{'TTFT p95':>10}{'ITL p50':>9}{'ITL p95':>9}"
    )
    c1 = best("service c=1").tokens_per_s
    for name in variants:
        r = best(name)
        ratio = f"{r.tokens_per_s / c1:.2f}x" if name.startswith("service") else ""
        print(
            f"{name:<16}{r.tokens_per_s:>11.1f}{median_tps(name):>10.1f}{ratio:>8}"
            f"{pct(r.ttft, 0.5) * 1e3:>10.0f}{pct(r.ttft, 0.95) * 1e3:>10.0f}"
            f"{pct(r.itl, 0.5) * 1e3:>9.1f}{pct(r.itl, 0.95) * 1e3:>9.1f}"
        )
    raw1, s1 = best("raw single"), best("service c=1")
    alone = pct(s1.ttft, 0.5)
    if prefills:
        print(
            f"first token, {args.pairs} pairs, ms: raw prefill median "
            f"{statistics.median(prefills) * 1e3:.0f} best {min(prefills) * 1e3:.0f}; "
            f"service TTFT median {statistics.median(firsts) * 1e3:.0f} "
            f"best {min(firsts) * 1e3:.0f}"
        )
    lines = [
        ("service c=1 / raw single", f"{s1.tokens_per_s / raw1.tokens_per_s:.3f}x", ">= 0.97x"),
        ("TTFT c=1 p50 - raw prefill", f"{(alone - raw1.ttft[0]) * 1e3:.0f} ms", "(best rounds)"),
    ]
    if prefills:
        overhead = statistics.median(firsts) - statistics.median(prefills)
        paired = statistics.median(f - p for p, f in zip(prefills, firsts, strict=True))
        lines += [
            ("  of the pairs' medians", f"{overhead * 1e3:.1f} ms", "<= 15 ms"),
            ("  median of each pair's", f"{paired * 1e3:.1f} ms", "<= 15 ms"),
        ]
    if args.alone:
        medians = median_tps("service c=1") / median_tps("raw single")
        lines.append(("  the same, of the medians", f"{medians:.3f}x", ">= 0.97x"))
        for name, value, target in lines:
            print(f"{name:<30}{value:>10}   target {target}")
        return 0
    raw8, s8 = best("raw batch of 8"), best("service c=8")
    step = pct(s8.steps, 0.5)
    lines = [
        ("service c=8 / service c=1", f"{s8.tokens_per_s / s1.tokens_per_s:.3f}x", ">= 4x"),
        ("service c=8 / raw batch of 8", f"{s8.tokens_per_s / raw8.tokens_per_s:.3f}x", ">= 0.85x"),
        *lines,
        (
            "late joiner TTFT (best)",
            f"{min(late) * 1e3:.1f} ms",
            f"<= 2x alone + one step of c=8 ({step * 1e3:.1f}) = {(2 * alone + step) * 1e3:.1f} ms",
        ),
    ]
    for name, value, target in lines:
        print(f"{name:<30}{value:>10}   target {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
