"""Greedy answers of the service's engine beside the eager transformers path.

    .venv/bin/python bench/greedy_parity.py [--tokens 128]

The engine runs the model as the worker loads it (``workers.loading``: its
own forward pass, ``engine.decoder``, with the linear layers packed for
oneDNN and in blocks on a CPU; the decoding rows attending together;
prompts and decoding rows in one forward pass), 9 requests submitted at
once (8 rows at a time). The eager path is the same weights through
transformers' own modules and ``F.linear`` (``linear = "torch"``), one
request at a time through ``model.generate`` (``tests.reference.generate``).
Both greedy, ``--tokens`` tokens. For every prompt: equal token for token,
or where the answers part, with the eager model's logits there: the gap
between its token and the engine's, and between its two best tokens. A
report, not a verdict: a faster kernel adds its products in another order,
and a near tie may then tip the other way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run

MODEL = "smollm2:135m"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    import django

    django.setup()
    import torch

    from bench.bench_engines import QUESTIONS, prompt_ids
    from bench.bench_vllm import PROMPT
    from engine.client import BatchingEngine
    from engine.interface import SamplingParams
    from generation.registry import get_model
    from tests.reference import generate
    from workers.loading import load_model

    spec = get_model(MODEL)
    served = load_model(spec)
    eager = load_model(dataclasses.replace(spec, linear="torch"))
    print(f"engine: {served.spec.linear} linear layers; eager: transformers' modules, "
          f"{eager.spec.linear} linear layers; {args.tokens} tokens, greedy")  # fmt: skip
    texts = [PROMPT, *QUESTIONS]  # bench_vllm's prompt, then bench_engines' 8
    inputs = [prompt_ids(served, text) for text in texts]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0)

    alone: list[list[int]] = []
    for ids in inputs:
        out: list[int] = []
        generate(eager, ids, sampling, lambda token_id, out=out: out.append(token_id) or False)
        alone.append(out)
    batching = BatchingEngine(served, max_batch=8)
    try:
        generations = [batching.add_request(ids, sampling) for ids in inputs]
        for generation in generations:
            generation.wait()
    finally:
        batching.close(timeout=60)

    equal = 0
    for text, ids, expected, generation in zip(texts, inputs, alone, generations, strict=True):
        got = generation.token_ids
        if got == expected:
            equal += 1
            print(f"equal ({len(got)} tokens): {text!r}")
            continue
        at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                  min(len(expected), len(got)))  # fmt: skip
        if at == min(len(expected), len(got)):
            print(f"lengths differ ({len(expected)} eager, {len(got)} engine): {text!r}")
            continue
        with torch.inference_mode():
            logits = eager.model(torch.tensor([ids + expected[:at]])).logits[0, -1].float()
        best, second = logits.topk(2).values.tolist()
        gap = float(logits[expected[at]] - logits[got[at]])
        print(
            f"first difference at token {at} of {len(expected)}: eager {expected[at]}, engine "
            f"{got[at]}; eager logit gap between them {gap:.3g} (its two best: "
            f"{best - second:.3g}): {text!r}"
        )
    print(f"{equal} of {len(texts)} answers equal token for token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
