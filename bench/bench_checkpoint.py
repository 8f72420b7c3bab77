"""Bytes a running task writes per output token, checkpoints included.

    .venv/bin/python bench/bench_checkpoint.py [--flush-tokens 2] [--lengths 256 4096]

A task is submitted and claimed through the service's own functions, then
flushed the way the runner flushes: every ``--flush-tokens`` tokens, one
transaction with the delta events, the new token ids and the checkpoint
(``tasks_app.checkpoints.record_progress``). Two variants, side by side:

- service: the checkpoint as written now (token count, detokenizer offsets,
  the assembler without its text) plus the new ids in a ``TokenChunk`` row;
- baseline: the checkpoint as written before (every token id so far and the
  whole assembler state, rewritten at each flush), through the same call.

Bytes are PostgreSQL's own: the write-ahead log grown over the run
(``pg_current_wal_insert_lsn``), divided by the number of tokens. The JSON
that each variant hands to PostgreSQL is counted too. Three rounds per
length, the variants alternated (baseline first, then service first); the
verdict is on the median of the rounds' service / baseline ratios
(``bench/verdict.py``). Uses the embedded
PostgreSQL and Redis of ``lmsp_project.devstack`` unless DATABASE_URL /
REDIS_URL are set; each task is closed as cancelled at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run

from verdict import Target, verdicts  # noqa: E402

ROUNDS = 3
AT_FLUSH = {"flush_tokens": 2}
# Fixed before measuring: the service never writes more WAL than the old
# checkpoint, and at 4,096 tokens (where the old one rewrote thousands of ids
# at each flush) at most 85 % of it.
TARGETS = [
    Target("WAL service / baseline at 256", 1.0, at_most=True, unit="x", conditions=AT_FLUSH),
    Target("WAL service / baseline at 4096", 0.85, at_most=True, unit="x", conditions=AT_FLUSH),
]

STORY = (
    "The lighthouse keeper counted the ships that passed each night, writing their names "
    "in a book whose pages had gone yellow with salt. One winter a ship came that had no "
    "name at all, only a lantern swinging from its mast and a crew that never spoke. "
)


def run(lengths: list[int], flush_tokens: int) -> None:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from engine.detokenizer import IncrementalDetokenizer
    from generation.output import OutputAssembler
    from generation.registry import get_model
    from lmsp_core.status import Status
    from responses_app.serializers import validate_response_request
    from responses_app.submit import prepare_generation, start_generation
    from tasks_app import checkpoints, claims, endings
    from tasks_app.models import TaskKind
    from workers.loading import load_tokenizer

    call_command("migrate", verbosity=0)
    owner, _ = get_user_model().objects.get_or_create(username="bench-checkpoint")
    spec = get_model("smollm2:135m")
    tokenizer = load_tokenizer(spec)
    story_ids = tokenizer(STORY * 200, add_special_tokens=False)["input_ids"]

    def wal() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')")
            return int(cursor.fetchone()[0])

    def one(length: int, variant: str) -> tuple[float, float]:
        request = validate_response_request(
            {
                "model": spec.id,
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Tell me a long story."}],
                    }
                ],
                "max_output_tokens": length,
            }
        )
        task = start_generation(owner, prepare_generation(owner, request), TaskKind.TASK)
        task = claims.claim(task.id, "bench")
        assembler = OutputAssembler(task.response_id)
        detok = IncrementalDetokenizer(tokenizer)
        ids: list[int] = []
        handed = 0
        start = wal()
        for position in range(0, length, flush_tokens):
            new = story_ids[position : min(position + flush_tokens, length)]
            events = []
            for token_id in new:
                ids.append(token_id)
                events += assembler.feed(detok.step(ids))
            if variant == "service":
                checkpoint = {
                    "tokens": len(ids),
                    "detokenizer": detok.offsets(),
                    "assembler": assembler.compact_state(),
                }
                handed += len(json.dumps(checkpoint)) + len(json.dumps(new))
                checkpoints.record_progress(task.id, task.attempt, events, new, checkpoint)
            else:
                checkpoint = {
                    "token_ids": list(ids),
                    "detokenizer": detok.offsets(),
                    "assembler": assembler.state(),
                }
                handed += len(json.dumps(checkpoint))
                checkpoints.record_progress(task.id, task.attempt, events, [], {**checkpoint})
        written = wal() - start
        # Closed as a worker closes a cancelled task: nothing is left running
        # (or in the old checkpoint format) for a sweeper to find.
        endings.finish(task.id, task.attempt, [], endings.Outcome(status=Status.CANCELLED))
        return written / length, handed / length

    print(f"bytes per output token, flushing every {flush_tokens} tokens")
    print(f"{'tokens':>7} {'variant':>9} {'WAL B/token':>12} {'JSON B/token':>13}")
    ratios: dict[str, list[float]] = {}
    for length in lengths:
        results: dict[str, list[tuple[float, float]]] = {"baseline": [], "service": []}
        for number in range(ROUNDS):  # alternated: baseline first, then service first
            order = ("baseline", "service") if number % 2 == 0 else ("service", "baseline")
            for variant in order:
                results[variant].append(one(length, variant))
            ratio = results["service"][-1][0] / results["baseline"][-1][0]
            ratios.setdefault(f"WAL service / baseline at {length}", []).append(ratio)
        for variant in ("baseline", "service"):
            wal_median = statistics.median(r[0] for r in results[variant])
            handed = results[variant][0][1]
            print(f"{length:>7} {variant:>9} {wal_median:>12.0f} {handed:>13.0f}   (medians)")
    print()
    for line in verdicts(TARGETS, ratios, {"flush_tokens": flush_tokens}):
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flush-tokens", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 4096])
    args = parser.parse_args()
    from lmsp_project.devstack import with_services

    with_services(lambda: run(args.lengths, args.flush_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
