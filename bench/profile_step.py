"""Where one decoding step of the engine spends its time (issue 26).

    .venv/bin/python bench/profile_step.py [--rows 1 8] [--steps 30] [--context 200]

Loads the model as the worker does (``workers.loading``), runs on the
engine's threads (every core: ``workers.loading.engine_threads``), puts ``--rows`` requests of a
``--context``-token prompt into a ``ModelRunner``, and times decoding steps
(one token per row) three ways, each the median of ``--steps`` steps:

- the runner's whole step (``ModelRunner.execute``: packing, the forward
  pass with the rows attending together, sampling);
- transformers' own forward pass over the same rows, as it runs a batch
  with its own cache (``DynamicCache``, left-padded rows): what eager
  transformers costs, with no engine around it;
- the engine's linear products alone, in the layout it loaded them in
  (every weight read once: the floor any engine that reads fp32 weights on
  this CPU pays per step).

``--linear torch`` computes the products with ``F.linear`` over the weights
as loaded instead of the packed and blocked layouts (the "before" of
issue 26).

Then torch's profiler over ``--steps`` runner steps: the operators by self
CPU time, and the step split into the engine's parts (attention rows,
sampling, the rest of the forward pass). Nothing here is a verdict: it says
where to look; ``bench_vllm.py`` judges.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run

MODEL = "smollm2:135m"


def median_ms(run: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--linear", choices=["auto", "packed", "torch"], default="auto")
    args = parser.parse_args()

    import django

    django.setup()
    import dataclasses

    import torch

    from generation.registry import get_model
    from workers.loading import load_model

    lm = load_model(dataclasses.replace(get_model(MODEL), linear=args.linear))
    if lm.threads:  # as the engine's thread runs its steps
        torch.set_num_threads(lm.threads)
    print(
        f"{MODEL}: {lm.model.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    for rows in args.rows:
        with torch.inference_mode():
            steps = Steps(lm, rows, args.context, max(args.rows))
            engine_ms = median_ms(steps.engine_step, args.steps)
            plain_ms = median_ms(steps.transformers_step, args.steps)
            linear_ms = median_ms(steps.linear_layers, args.steps)
            print(
                f"\n=== {rows} row(s), context {args.context}: engine step {engine_ms:.1f} ms, "
                f"transformers' own decode step {plain_ms:.1f} ms, "
                f"linear products alone {linear_ms:.1f} ms ({len(steps.products)} products)"
            )
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    with torch.profiler.record_function("engine_step"):
                        steps.engine_step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    return 0


class Steps:
    """``rows`` requests of a ``context``-token prompt, prefilled, and the
    three ways to take one decoding step over them."""

    def __init__(self, lm: Any, rows: int, context: int, max_batch: int) -> None:
        import torch
        from transformers import DynamicCache

        from engine.model_runner import ModelRunner, RowSampling
        from engine.request import Request
        from engine.scheduler import Chunk

        model = self.model = lm.model
        self.runner = ModelRunner(lm.decoder, max_batch)
        self.requests = [
            Request(
                id=n,
                prompt_ids=[(7 * n + i) % 5000 + 100 for i in range(context)],
                max_new_tokens=10_000,
                eos_token_ids=frozenset(),
            )
            for n in range(rows)
        ]
        self.positions = {r.id: context for r in self.requests}
        self.last: dict[int, int] = {}
        for request in self.requests:
            self.runner.add(request.id, RowSampling(temperature=0.0))
            plan = _plan([Chunk(request.id, 0, request.prompt_ids, True)])
            self.last.update(self.runner.execute(plan).sampled)
        ids = torch.tensor([r.prompt_ids for r in self.requests])
        self.cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.length = context
        self.step_ids = ids[:, -1:]
        # In the layout the engine loaded them in, each with an input of its width.
        decoder = lm.decoder
        hidden = torch.randn(rows, decoder.hidden_size)
        inter = torch.randn(rows, decoder.intermediate_size)
        self.products = [
            pair
            for layer in decoder.layers
            for pair in ((layer.qkv, hidden), (layer.o, hidden), (layer.gate_up, hidden))
            + ((layer.down, inter),)
        ] + [(decoder.head, hidden)]

    def engine_step(self) -> None:
        from engine.scheduler import Chunk

        chunks = [
            Chunk(r.id, self.positions[r.id], [self.last[r.id]], True, prefill=False)
            for r in self.requests
        ]
        for request in self.requests:
            self.positions[request.id] += 1
        self.last.update(self.runner.execute(_plan(chunks)).sampled)

    def transformers_step(self) -> None:
        import torch

        self.length += 1
        self.model(
            input_ids=self.step_ids,
            past_key_values=self.cache,
            use_cache=True,
            attention_mask=torch.ones((len(self.requests), self.length), dtype=torch.long),
            logits_to_keep=1,
        )

    def linear_layers(self) -> None:
        for product, x in self.products:
            product(x)


def _plan(chunks: list) -> object:  # noqa: ANN001 - a StepPlan
    from engine.scheduler import StepPlan

    return StepPlan(memory_ops=[], chunks=chunks, ended=[])


if __name__ == "__main__":
    sys.exit(main())
