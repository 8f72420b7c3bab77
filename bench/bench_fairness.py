"""Output tokens per second per owner, with four owners of unequal demand
sharing one model worker.

    .venv/bin/python bench/bench_fairness.py [--tokens 8] [--demand 10 8 6 4]

Starts the real service (web, one model worker, the ops worker with the
sweeper; ``tests/stack.py``) on the embedded PostgreSQL and a private Redis
(or DATABASE_URL), then four owners submit their tasks through HTTP, one
owner after the other, the biggest backlog first; each task is one greedy
generation of ``--tokens`` output tokens of the same prompt. Once all are
done it prints, per owner, the output tokens and tokens/s over the window in
which every owner had work: from the first task started after the last
owner's first submit until each owner has had as many tasks done since then
as the owner who asked for least (the end of that round; a task partly
inside the window counts for that part of its tokens), and the max/min
ratio of those shares: 1.00 is an even split, while served in the broker's
order the first owner would have had the worker to itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

PROMPT = "Write a long, detailed story about a lighthouse keeper."
FINAL = {"completed", "incomplete", "failed", "cancelled"}


def run(tokens: int, demand: list[int]) -> None:
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connections

    from accounts_app.models import SCOPES
    from accounts_app.services import create_token
    from lmsp_project.devstack import free_port
    from tasks_app.models import Task
    from tests.stack import Stack

    call_command("migrate", verbosity=0)
    names = [f"bench-owner-{i + 1}" for i in range(len(demand))]
    secrets = {name: create_token(username=name, scopes=list(SCOPES)).secret for name in names}
    stack = Stack(connections["default"].settings_dict, free_port())
    stack.start()
    try:
        body = {
            "type": "response",
            "request": {
                "model": "smollm2:135m",
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": PROMPT}],
                    }
                ],
                "max_output_tokens": tokens,
                "temperature": 0,
            },
        }

        def submit(name: str, count: int) -> list[str]:
            with stack.client(secrets[name]) as client:
                ids = []
                for _ in range(count):
                    answer = client.post("/lmsp/v1/tasks", json=body)
                    answer.raise_for_status()
                    ids.append(answer.json()["id"])
                return ids

        # One owner after the other, the biggest backlog first: served in the
        # broker's order, the first owner would keep the worker to itself.
        ids = {name: submit(name, count) for name, count in zip(names, demand, strict=True)}
        owner_of = {task_id: name for name, owned in ids.items() for task_id in owned}
        while Task.objects.filter(id__in=owner_of).exclude(status__in=FINAL).exists():
            time.sleep(0.5)
        rows = list(
            Task.objects.filter(id__in=owner_of)
            .select_related("response")
            .values_list(
                "id", "created_at", "started_at", "completed_at", "response__output_tokens"
            )
        )
    finally:
        stack.stop()

    # The window: from the first task started once every owner had submitted
    # (the first slot handed out while all of them had work) to the end of the
    # round in which the owner who asked for least ran out, i.e. until every
    # owner has had as many tasks done since then as that owner asked for.
    rounds = min(demand)
    all_in = max(
        min(created.timestamp() for tid, created, *_ in rows if owner_of[tid] == name)
        for name in names
    )
    start = min(t.timestamp() for _, _, t, _, _ in rows if t.timestamp() >= all_in)
    end = max(
        sorted(
            done.timestamp()
            for tid, _, started, done, _ in rows
            if owner_of[tid] == name and started.timestamp() >= start
        )[:rounds][-1]
        for name in names
    )
    window = end - start
    served = dict.fromkeys(names, 0.0)
    for task_id, _, started_at, completed_at, output_tokens in rows:
        begin, stop = started_at.timestamp(), completed_at.timestamp()
        overlap = min(stop, end) - max(begin, start)
        if overlap > 0:  # a task partly in the window counts for that part of its tokens
            served[owner_of[task_id]] += output_tokens * overlap / max(stop - begin, 1e-9)
    print(f"{len(names)} owners, demand {demand} tasks of {tokens} tokens, window {window:.1f} s")
    for name, count in zip(names, demand, strict=True):
        rate = served[name] / window
        print(f"  {name}: {count:3d} tasks, {served[name]:7.1f} tokens, {rate:6.2f} tok/s")
    low, high = min(served.values()), max(served.values())
    rates = " / ".join(f"{served[name] / window:.2f}" for name in names)
    print(f"per-owner tokens/s while all have work: {rates}; max/min {high / max(low, 1):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--demand", type=int, nargs="+", default=[10, 8, 6, 4])
    args = parser.parse_args()
    from lmsp_project.devstack import with_services

    with_services(lambda: run(args.tokens, args.demand))
    return 0


if __name__ == "__main__":
    sys.exit(main())
