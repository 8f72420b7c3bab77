"""Aggregate tokens/s: one generate, a static batch, the batching engine, transformers' CB.

    .venv/bin/python bench/bench_engines.py [--model smollm2:135m] [--rounds 5] [--tokens 64]

Five variants on the same 8 chat prompts (different lengths), greedy, every
sequence generating exactly ``--tokens`` tokens (end tokens are ignored), so
they all do the same work:

- ``single``: ``model.generate`` on one prompt (the worker's path today);
- ``static8``: ``model.generate`` on all 8 prompts, left-padded, one batch;
- ``engine1`` / ``engine8``: ``engine.client.BatchingEngine`` with 1 and 8
  concurrent requests (submitted together, waited for together);
- ``cb8``: transformers' continuous batching (``init_continuous_batching``,
  paged cache) with the same 8 requests.

Times run from submitting to the last token, prefill included; engine and
CB set-up (thread start, cache allocation) is outside the clock. Variants
that are compared run next to each other, in an order that flips every
round, so a change in machine load hits them alike. Printed: each round,
the medians and the best rounds (for information), then the verdict on each
ratio the batching work aims at (``bench/verdict.py``): the median of each
round's own ratio against its target, fixed before measuring.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run

import django  # noqa: E402

django.setup()

import torch  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from verdict import Target, verdicts  # noqa: E402

from engine.client import BatchingEngine  # noqa: E402
from engine.interface import SamplingParams  # noqa: E402
from generation import prompts  # noqa: E402
from generation.params import GenerationParams  # noqa: E402
from generation.registry import get_model  # noqa: E402
from generation.tokens import prompt_tokenizer  # noqa: E402
from workers.loading import LoadedModel, load_model  # noqa: E402

QUESTIONS = [
    "Say hello.",
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Explain gravity to a child in two sentences.",
    "Count from one to ten in words.",
    "Why is the sky blue?",
    "Give me a name for a cat, and tell me why you chose it.",
]
VARIANTS = ["single", "static8", "engine1", "engine8", "cb8"]


def prompt_ids(lm: LoadedModel, text: str) -> list[int]:
    message = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    tokenizer = prompt_tokenizer(lm.spec)
    rendered = prompts.render_prompt(lm.spec, tokenizer, [message], GenerationParams())
    return lm.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def left_padded(prompts_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in prompts_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_ids])
    return ids, mask


class Bench:
    def __init__(self, lm: LoadedModel, tokens: int) -> None:
        self.lm = lm
        self.tokens = tokens
        self.prompts = [prompt_ids(lm, q) for q in QUESTIONS]
        self.pad = sorted(lm.eos_token_ids)[0]
        self.engine1 = BatchingEngine(lm, max_batch=1, name="bench-engine1")
        self.engine8 = BatchingEngine(lm, max_batch=8, name="bench-engine8")
        self.cb_generation_config = GenerationConfig(
            max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=self.pad
        )
        # A cache sized for this work; left alone it would take most of the RAM.
        self.cb_config = ContinuousBatchingConfig(
            num_blocks=32, max_batch_tokens=1024, max_requests_per_batch=8
        )

    def generate(self, prompts_ids: list[list[int]]) -> int:
        ids, mask = left_padded(prompts_ids, self.pad)
        out = self.lm.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=self.tokens,
            min_new_tokens=self.tokens,
            do_sample=False,
            pad_token_id=self.pad,
        )
        return int(out[:, ids.shape[1] :].numel())

    def single(self) -> int:
        return self.generate(self.prompts[:1])

    def static8(self) -> int:
        return self.generate(self.prompts)

    def engine(self, batching: BatchingEngine, count: int) -> int:
        sampling = SamplingParams(max_tokens=self.tokens, temperature=0)
        gens = [batching.add_request(p, sampling, eos_token_ids=()) for p in self.prompts[:count]]
        for gen in gens:
            gen.wait()
            assert gen.error is None and len(gen.token_ids) == self.tokens, gen.finish_reason
        return sum(len(gen.token_ids) for gen in gens)

    def engine1_run(self) -> int:
        return self.engine(self.engine1, 1)

    def engine8_run(self) -> int:
        return self.engine(self.engine8, 8)

    def cb8(self) -> tuple[int, float]:
        """Tokens and seconds; the manager's start and stop are outside the clock."""
        manager = self.lm.model.init_continuous_batching(
            generation_config=self.cb_generation_config,
            continuous_batching_config=self.cb_config,
        )
        manager.start()
        try:
            started = time.perf_counter()
            for p in self.prompts:
                manager.add_request(p, max_new_tokens=self.tokens, eos_token_id=-1)
            finished = 0
            tokens = 0
            while finished < len(self.prompts):
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("continuous batching returned no result")
                if result.is_finished():
                    assert result.error is None, result.error
                    finished += 1
                    tokens += len(result.generated_tokens)
            return tokens, time.perf_counter() - started
        finally:
            manager.stop(block=True, keep_for_next_session=True)

    def run(self, variant: str) -> float:
        """Aggregate tokens/s of one run of ``variant``."""
        runs: dict[str, Callable[[], int]] = {
            "single": self.single,
            "static8": self.static8,
            "engine1": self.engine1_run,
            "engine8": self.engine8_run,
        }
        with torch.inference_mode():
            if variant == "cb8":
                tokens, seconds = self.cb8()
            else:
                started = time.perf_counter()
                tokens = runs[variant]()
                seconds = time.perf_counter() - started
        return tokens / seconds

    def close(self) -> None:
        self.engine1.close()
        self.engine8.close()


AT_DEFAULTS = {"model": "smollm2:135m", "tokens": 64}
# (top, bottom): the ratio top / bottom of each round, judged on their median.
RATIOS = {
    ("engine8", "static8"): 0.85,
    ("engine8", "engine1"): 4.0,
    ("engine1", "single"): 0.97,
}
TARGETS = [
    Target(f"{top}/{bottom}", bound, at_most=False, unit="x", fmt=".2f", conditions=AT_DEFAULTS)
    for (top, bottom), bound in RATIOS.items()
]
COMPARED = [("cb8", "engine8")]  # transformers' CB against the engine: no target


def round_order(round_index: int) -> list[str]:
    """The variants compared with each other run next to each other, in an
    order that flips from round to round, so load drifts hit them alike."""
    small, large = ["single", "engine1"], ["static8", "engine8", "cb8"]
    if round_index % 2:
        small, large = small[::-1], large[::-1]
    return small + large if round_index % 4 < 2 else large + small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    import logging

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    lm = load_model(get_model(args.model))
    bench = Bench(lm, args.tokens)
    print(
        f"{args.model} on {lm.model.device} ({lm.model.dtype}), {args.tokens} greedy tokens "
        f"per sequence, prompts of {min(map(len, bench.prompts))}-"
        f"{max(map(len, bench.prompts))} tokens, {torch.get_num_threads()} torch threads"
    )
    warmup = Bench.__new__(Bench)
    warmup.__dict__.update(bench.__dict__, tokens=8)
    for variant in VARIANTS:  # first calls allocate and compile kernels
        warmup.run(variant)

    results: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        for variant in round_order(round_index):
            results[variant].append(bench.run(variant))
        line = "  ".join(f"{v} {results[v][-1]:6.1f}" for v in VARIANTS)
        print(f"round {round_index + 1}: {line}  tokens/s")
    bench.close()

    medians = {v: statistics.median(r) for v, r in results.items()}
    bests = {v: max(r) for v, r in results.items()}
    print("median : " + "  ".join(f"{v} {medians[v]:6.1f}" for v in VARIANTS) + "  tokens/s")
    print("best   : " + "  ".join(f"{v} {bests[v]:6.1f}" for v in VARIANTS) + "  tokens/s")
    ratios = {
        f"{top}/{bottom}": [a / b for a, b in zip(results[top], results[bottom], strict=True)]
        for top, bottom in [*RATIOS, *COMPARED]
    }
    for top, bottom in COMPARED:
        name = f"{top}/{bottom}"
        print(f"{name}: median {statistics.median(ratios[name]):.2f}x (no target)")
    settings = {"model": args.model, "tokens": args.tokens}
    for line in verdicts(TARGETS, ratios, settings):
        print(line)


if __name__ == "__main__":
    main()
