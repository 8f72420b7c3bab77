"""Thousands of followers of one task on one web process: what they cost.

    .venv/bin/python bench/bench_fanout.py                      # the verdict run: 5000, 10000 idle
    .venv/bin/python bench/bench_fanout.py --followers 500 --idle 0 --no-baseline
    .venv/bin/python bench/bench_fanout.py --followers 50 --idle 100 --events 5 --idle-seconds 1 \
        --hold-seconds 1 --no-baseline --no-floor               # a smoke run
    .venv/bin/python bench/bench_fanout.py --baseline-commit c087128   # against another commit

Three processes, so that nobody measures itself: this driver (it plays the
model worker, writing events through ``tasks_app.checkpoints`` exactly as a
worker does, and reads the server's RSS and PostgreSQL's counters), one web
server (uvicorn, one process, open-file limit raised) and a lean client
(``client`` subcommand: raw asyncio protocols reading SSE, no HTTP library).

Each variant (this tree, then the baseline: commit 3effd36, or the one
``--baseline-commit`` names, exported with
``git archive`` into ``.data/bench-baseline-<commit>`` and served from there
with the same virtualenv, database and Redis; the driver submits the task a
variant streams, through this tree's code) runs:

1. N followers connect to a queued task (at most ``--connect-window`` in
   flight): time until all of them received event 1;
2. they idle ``--idle-seconds``: database queries per idle follower per
   second, counted as the scans of the tables streams read
   (``pg_stat_user_tables``; the transactions of the bench database are
   printed beside them), with the web process's safety check (one query per
   process, not per feed) pushed past the run (``LMSP_STREAM_CHECK_SECONDS``);
3. the driver claims the task and writes ``--events`` deltas at ``--rate``
   per second, one transaction each, then the final event: per-event arrival
   spread across followers (each arrival minus that event's first arrival),
   and how many followers got the whole contiguous stream 1..final;
4. web RSS per follower: (RSS with N followers idle - RSS before) / N;
5. ``--idle`` followers of another queued task held at once for
   ``--hold-seconds``, then released by cancelling that task (new code only
   unless ``--idle-baseline``).

Delivery is measured from the commit: the driver writes each event in a
transaction and takes the time right after its COMMIT (an on-commit hook
that runs before the event is published), and every follower's arrival of
that event minus it is one sample of the commit-to-arrival latency (the
clocks agree: one machine, ``time.monotonic``). The spread (an arrival minus
the event's first arrival) is printed beside it: a delay that hits every
follower alike does not show in it.

``--rounds`` (3) rounds run the variants alternated (this tree, the
baseline; then the baseline first). The targets (issue 11; for delivery
the same 250 ms applied from the commit), fixed before measuring and judged
on the median of this tree's rounds, the best round beside it for
information (``bench/verdict.py``), at 5,000 followers and 10,000 idle
ones (other sizes print no verdict): every stream whole, all connected
within 10 s, commit-to-arrival p99 <= 250 ms, spread p99 <= 250 ms, at
most 20 KiB of web RSS per follower, no query per idle follower, and
10,000 idle followers held open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from verdict import Target, verdicts  # noqa: E402

BENCH_DB = "lmsp_bench"
BASELINE = "3effd36"
STATS_SETTLE_SECONDS = 11
AT_SIZE = {"followers": 5000}
TARGETS = [
    Target("whole streams / followers", 1.0, at_most=False, fmt=".4f", conditions=AT_SIZE),
    Target("time to connect all", 10.0, at_most=True, unit=" s", fmt=".2f", conditions=AT_SIZE),
    Target("commit-to-arrival p99", 250.0, at_most=True, unit=" ms", fmt=".0f", conditions=AT_SIZE),
    Target("arrival spread p99", 250.0, at_most=True, unit=" ms", fmt=".0f", conditions=AT_SIZE),
    Target("web RSS per follower", 20.0, at_most=True, unit=" KiB", fmt=".1f", conditions=AT_SIZE),
    Target("queries per idle follower per s", 0.0, at_most=True, fmt=".4f", conditions=AT_SIZE),
    Target("idle followers held open", 10000, at_most=False, fmt=".0f", conditions={"idle": 10000}),
]


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the lean client ------------------------------------------------------------------


class SSEFollower(asyncio.Protocol):
    """One follower on a raw socket: records when each event id arrived."""

    def __init__(self, request: bytes, first: asyncio.Future) -> None:
        self.request = request
        self.first = first  # resolved at the first event (or on failure)
        self.buffer = b""
        self.head_done = False
        self.status = 0
        self.ids: list[int] = []
        self.times: list[float] = []
        self.final = False
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        self.buffer += data
        if not self.head_done:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status = int(self.buffer.split(b" ", 2)[1])
            self.buffer = self.buffer[end + 4 :]
            self.head_done = True
            if self.status != 200 and not self.first.done():
                self.first.set_result(False)
        while True:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                return
            block, self.buffer = self.buffer[:end], self.buffer[end + 2 :]
            # chunked transfer encoding puts size lines between frames: skip them
            event_id = None
            for line in block.split(b"\n"):
                line = line.strip(b"\r")
                if line.startswith(b"id: "):
                    event_id = int(line[4:])
                elif line.startswith(b"event: response.") and line[16:] in (
                    b"completed",
                    b"incomplete",
                    b"failed",
                    b"cancelled",
                ):
                    self.final = True
            if event_id is not None:
                self.ids.append(event_id)
                self.times.append(now)
                if not self.first.done():
                    self.first.set_result(True)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.first.done():
            self.first.set_result(False)
        if not self.closed.done():
            self.closed.set_result(True)


async def run_client(args: argparse.Namespace) -> None:
    raise_nofile()
    loop = asyncio.get_running_loop()
    request = (
        f"GET {args.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {args.token}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    followers: list[SSEFollower] = []
    window = asyncio.Semaphore(args.connect_window)
    started = time.monotonic()

    async def connect() -> None:
        async with window:
            first = loop.create_future()
            try:
                _, protocol = await loop.create_connection(
                    lambda: SSEFollower(request, first), "127.0.0.1", args.port
                )
            except OSError:
                return
            followers.append(protocol)
            await first

    await asyncio.gather(*(connect() for _ in range(args.n)))
    ok = sum(1 for f in followers if f.status == 200 and f.ids)
    emit({"connected": ok, "seconds": time.monotonic() - started})
    # Wait for the driver: "hold" (report how many are still open) or "end".
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if line == "open":
            emit({"open": sum(1 for f in followers if not f.closed.done())})
        elif line == "end" or not line:
            break
    deadline = time.monotonic() + args.end_timeout
    for follower in followers:
        remaining = deadline - time.monotonic()
        if remaining > 0 and not follower.closed.done():
            try:
                await asyncio.wait_for(asyncio.shield(follower.closed), remaining)
            except TimeoutError:
                pass
    whole = 0
    arrivals: dict[int, list[float]] = {}
    for follower in followers:
        if follower.final and follower.ids == list(range(1, len(follower.ids) + 1)):
            whole += 1
        for event_id, moment in zip(follower.ids, follower.times, strict=True):
            arrivals.setdefault(event_id, []).append(moment)
    emit(
        {
            "whole": whole,
            "followers": len(followers),
            "arrivals": {str(k): v for k, v in arrivals.items()},
        }
    )


def emit(value: dict) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


# --- the driver ---------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Client:
    def __init__(self, port: int, token: str, path: str, n: int, args: argparse.Namespace) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "client",
                "--port",
                str(port),
                "--token",
                token,
                "--path",
                path,
                "--n",
                str(n),
                "--connect-window",
                str(args.connect_window),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the client exited")
        return json.loads(line)

    def send(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def finish(self) -> dict:
        self.send("end")
        result = self.read()
        self.process.wait(60)
        return result


def main_driver(args: argparse.Namespace) -> None:
    raise_nofile()
    sys.path.insert(0, str(ROOT))
    from lmsp_project.devstack import services

    with services() as env:
        os.environ.update(env)
        from service import bench_database

        bench_url = bench_database(env["DATABASE_URL"], BENCH_DB)
        os.environ["DATABASE_URL"] = bench_url
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
        os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run
        import django

        django.setup()
        variants = [("this branch", ROOT)]
        if args.baseline:
            commit = args.baseline_commit
            variants.append((f"baseline {commit}", export_baseline(commit)))
        figures: dict[str, dict[str, list[float]]] = {name: {} for name, _ in variants}
        for number in range(args.rounds):
            # alternated: this tree first in odd rounds, the baseline first in even ones
            for name, tree in variants if number % 2 == 0 else variants[::-1]:
                idle = args.idle if (tree == ROOT or args.idle_baseline) else 0
                for figure, value in run_variant(name, tree, args, idle).items():
                    figures[name].setdefault(figure, []).append(value)
        floor_lines = floors(args) if args.floor else []
        print()
        print(
            f"followers={args.followers} events={args.events} rate={args.rate}/s "
            f"idle-seconds={args.idle_seconds} rounds={args.rounds} load={os.getloadavg()[0]:.1f}"
        )
        size = {"followers": args.followers, "idle": args.idle}
        for name, _ in variants:
            print(f"--- {name}")
            for line in verdicts(TARGETS, figures[name], size):
                print("  " + line)
        if floor_lines:
            print("--- floors (no lmsp stream code)")
            for line in floor_lines:
                print("  " + line)


def export_baseline(commit: str) -> Path:
    tree = ROOT / ".data" / f"bench-baseline-{commit}"
    if not (tree / "manage.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


SERVER_BOOT = (
    "import resource, sys; s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (h, h)); "
    "import uvicorn.main; sys.argv[0] = 'uvicorn'; uvicorn.main.main()"
)


def start_server(
    tree: Path, port: int, app: str = "lmsp_project.asgi:application", **extra: str
) -> subprocess.Popen:
    from lmsp_project.devstack import DATA

    log = open(DATA / f"bench-web-{port}.log", "w")  # noqa: SIM115 - the child holds it
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "LMSP_MODEL_CACHE": str(DATA / "models"),
        "LMSP_MAX_STREAMS_PER_TOKEN": "100000",
        "LMSP_MAX_STREAMS_PER_PROCESS": "100000",
        "LMSP_MAX_STREAMS_PER_OWNER": "100000",  # one bench owner holds them all
        # The feed's safety check reads the task once per task (not per
        # follower) every LMSP_STREAM_CHECK_SECONDS: pushed past the run, so
        # that the idle count is the followers' own reads.
        "LMSP_STREAM_CHECK_SECONDS": "3600",
        "LMSP_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_BOOT, app]
        + [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--backlog",
            "4096",
            "--timeout-graceful-shutdown",
            "3",
        ],
        cwd=tree,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/lmsp/v1/tasks/x/events", timeout=0.5)
            return process
        except httpx.ReadTimeout:
            return process  # the floors' endpoint answers and then waits
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"the web server did not start; see {log.name}")


def counters() -> tuple[int, int]:
    """(transactions, scans of the tables streams read) of the bench database.

    Transactions (``pg_stat_database.xact_commit + xact_rollback``) count
    every statement of the server's autocommit connections but also
    autovacuum's work; scans (``seq_scan + idx_scan`` in
    ``pg_stat_user_tables`` of the task, event and token tables) count only
    reads of what streams read (a position, events, a token)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database"
            " WHERE datname = current_database()"
        )
        transactions = cursor.fetchone()[0]
        cursor.execute(
            "SELECT sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)) FROM pg_stat_user_tables"
            " WHERE relname IN ('tasks_app_task', 'tasks_app_event', 'accounts_app_apitoken')"
        )
        scans = int(cursor.fetchone()[0])
    return transactions, scans


def run_variant(name: str, tree: Path, args: argparse.Namespace, idle_n: int) -> dict[str, float]:
    """One round of one variant: its figure per target (printed as it goes)."""
    import httpx

    from accounts_app.services import create_token
    from lmsp_project.devstack import free_port

    print(f"=== {name}: {tree}", flush=True)
    token = create_token(username="bench", scopes=["tasks:read", "tasks:write"]).secret
    port = free_port()
    server = start_server(tree, port)
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    n = args.followers
    try:
        task_id = create_queued_task(token)
        read_once = api.get(f"/lmsp/v1/tasks/{task_id}", timeout=10)  # warm the server up
        assert read_once.status_code == 200
        time.sleep(1)
        rss_before = rss_kib(server.pid)
        client = Client(port, token, f"/lmsp/v1/tasks/{task_id}/events", n, args)
        connected = client.read()
        print(f"  connected {connected}", flush=True)
        time.sleep(1.5)
        rss_after = rss_kib(server.pid)
        # A backend that goes idle less than a second after its last report
        # keeps its counts up to 10 s (PostgreSQL's PGSTAT_IDLE_INTERVAL):
        # let the connect phase's counts arrive before the first reading, and
        # the idle phase's before the second (which then spans up to 11 s more
        # of idling, counted against the idle seconds: an overestimate).
        time.sleep(STATS_SETTLE_SECONDS)
        before = counters()
        time.sleep(args.idle_seconds)
        time.sleep(STATS_SETTLE_SECONDS)
        after = counters()
        transactions = after[0] - before[0] - 3  # less the driver's own reading
        scans = after[1] - before[1]
        commits = write_events(task_id, args)
        result = client.finish()
        latency, spreads = delivery(result["arrivals"], commits)
        figures = {
            "whole streams / followers": result["whole"] / n,
            "time to connect all": connected["seconds"],
            "commit-to-arrival p99": latency[1] * 1000,
            "arrival spread p99": spreads[1] * 1000,
            "web RSS per follower": (rss_after - rss_before) / n,
            "queries per idle follower per s": scans / n / args.idle_seconds,
        }
        lines = [
            f"whole contiguous streams: {result['whole']}/{n}",
            f"time to connect all {n}: {connected['seconds']:.2f} s "
            f"({connected['connected']} connected)",
            f"commit-to-arrival latency: p50 {latency[0] * 1000:.0f} ms, "
            f"p99 {latency[1] * 1000:.0f} ms",
            f"per-event arrival spread: p50 {spreads[0] * 1000:.0f} ms, "
            f"p99 {spreads[1] * 1000:.0f} ms",
            f"web RSS per follower: {(rss_after - rss_before) / n:.1f} KiB "
            f"({rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB)",
            f"database queries per idle follower per second: "
            f"{scans / n / args.idle_seconds:.4f} "
            f"({scans} scans of the task/event/token tables in {args.idle_seconds:.0f} s; "
            f"{transactions} transactions in the database, autovacuum included)",
        ]
        if idle_n:
            held, line = hold_idle(api, port, token, idle_n, args, server.pid)
            figures["idle followers held open"] = held
            lines.append(line)
    finally:
        server.terminate()
        server.wait(30)
    for line in lines:
        print("  " + line, flush=True)
    return figures


def floors(args: argparse.Namespace) -> list[str]:
    """RSS per idle connection of a bare ASGI app and of Django alone."""
    from lmsp_project.devstack import free_port

    lines = []
    n = args.followers
    path = str(ROOT / "bench") + os.pathsep + str(ROOT)
    for name, app, extra in [
        ("bare ASGI app under uvicorn", "fanout_floor:bare_app", {}),
        (
            "Django + project middleware, trivial streaming view",
            "lmsp_project.asgi:application",
            {"DJANGO_SETTINGS_MODULE": "fanout_floor"},
        ),
        (
            "the same, the request's thread let go (as streams did)",
            "lmsp_project.asgi:application",
            {"DJANGO_SETTINGS_MODULE": "fanout_floor", "LMSP_FLOOR_PARK": "1"},
        ),
        (
            "the same view and middleware under lmsp_core.lean (as streams are)",
            "fanout_floor:lean_app",
            {"DJANGO_SETTINGS_MODULE": "fanout_floor"},
        ),
    ]:
        port = free_port()
        server = start_server(ROOT, port, app, PYTHONPATH=path, **extra)
        try:
            time.sleep(1)
            rss_before = rss_kib(server.pid)
            client = Client(port, "none", "/lmsp/v1/tasks/x/events", n, args)
            connected = client.read()
            time.sleep(1.5)
            rss_after = rss_kib(server.pid)
            client.process.kill()
            client.process.wait(10)
        finally:
            server.terminate()
            server.wait(30)
        lines.append(
            f"{name}: {(rss_after - rss_before) / n:.1f} KiB RSS per idle connection, "
            f"{connected['connected']}/{n} connected in {connected['seconds']:.2f} s"
        )
        print("  " + lines[-1], flush=True)
    return lines


def create_queued_task(token: str) -> str:
    """A queued task, submitted through this tree's own view in this process
    (Django's test client), whichever variant then serves its stream: a
    baseline's submit writes the rows of its own, older schema, which the
    database migrated by this tree refuses (new columns without database
    defaults), while its stream code reads today's rows as they are."""
    from django.test import Client as DjangoClient
    from service import task_body

    answer = DjangoClient().post(
        "/lmsp/v1/tasks",
        task_body("x", 4),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert answer.status_code == 202, answer.content
    return answer.json()["id"]


def write_events(task_id: str, args: argparse.Namespace) -> dict[int, float]:
    """Play the worker: claim, one transaction per delta at ``rate``, then
    finish; returns each delta's commit time by event id."""
    from django.db import transaction

    from lmsp_core import protocol
    from lmsp_core.status import Status
    from tasks_app import checkpoints, claims, endings, lifecycle
    from tasks_app.models import Task

    # A claim takes the fairest queued task of the model, not this one: end what
    # an interrupted earlier run left queued in the bench database first.
    for other in Task.objects.filter(status=Status.QUEUED).exclude(id=task_id):
        lifecycle.request_cancel(other.id)
    task = claims.claim(task_id, "bench-driver")
    assert task is not None and task.id == task_id, "the driver did not claim its task"
    response_id = task.response_id
    item = "msg_bench"
    commits: dict[int, float] = {}
    events = [protocol.item_added_event(response_id, 0, protocol.message_item(item, None))]
    text = ""
    for index in range(args.events):
        started = time.monotonic()
        delta = f" word{index}"
        text += delta
        events.append(protocol.text_delta_event(response_id, item, delta))
        committed: list[float] = []
        with transaction.atomic():
            # Registered before the write's own hook (which publishes the
            # events): the time right after the COMMIT, before any follower
            # can have been told.
            transaction.on_commit(lambda at=committed: at.append(time.monotonic()))
            checkpoints.record_progress(task_id, task.attempt, events, [], {})
        commits[Task.objects.get(id=task_id).last_event_id] = committed[0]
        events = []
        time.sleep(max(0.0, 1 / args.rate - (time.monotonic() - started)))
    message = protocol.message_item(item, text)
    endings.finish(
        task_id,
        task.attempt,
        [
            protocol.item_done_event(response_id, 0, message),
            protocol.completed_event(response_id, protocol.usage(1, args.events)),
        ],
        endings.Outcome(status="completed", output=[message], output_tokens=args.events),
    )
    return commits


def delivery(arrivals: dict[str, list[float]], commits: dict[int, float]) -> tuple:
    """((p50, p99) of arrival minus the event's commit, (p50, p99) of arrival
    minus the event's first arrival), over every follower and event."""
    latencies: list[float] = []
    spreads: list[float] = []
    for event_id, committed in commits.items():
        moments = arrivals.get(str(event_id), [])
        if not moments:
            continue
        first = min(moments)
        latencies += [moment - committed for moment in moments]
        spreads += [moment - first for moment in moments]
    return (
        (percentile(latencies, 0.5), percentile(latencies, 0.99)),
        (percentile(spreads, 0.5), percentile(spreads, 0.99)),
    )


def hold_idle(api, port: int, token: str, n: int, args, pid: int) -> tuple[int, str]:  # noqa: ANN001
    task_id = create_queued_task(token)
    rss_before = rss_kib(pid)
    client = Client(port, token, f"/lmsp/v1/tasks/{task_id}/events", n, args)
    connected = client.read()
    print(f"  idle connected {connected}", flush=True)
    rss_after = rss_kib(pid)
    time.sleep(args.hold_seconds)
    client.send("open")
    still_open = client.read()["open"]
    api.post(f"/lmsp/v1/tasks/{task_id}/cancel")
    result = client.finish()
    return still_open, (
        f"idle followers held: {still_open}/{n} open after {args.hold_seconds:.0f} s "
        f"(connected in {connected['seconds']:.1f} s, "
        f"{(rss_after - rss_before) / n:.1f} KiB RSS each, "
        f"{result['whole']} whole streams after the cancel)"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        parser = argparse.ArgumentParser()
        parser.add_argument("client")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--token", required=True)
        parser.add_argument("--path", required=True)
        parser.add_argument("--n", type=int, required=True)
        parser.add_argument("--connect-window", type=int, default=200)
        parser.add_argument("--end-timeout", type=float, default=120)
        import uvloop

        uvloop.run(run_client(parser.parse_args()))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--followers", type=int, default=5000)
    parser.add_argument("--idle", type=int, default=10000, help="idle followers held (0: skip)")
    parser.add_argument("--events", type=int, default=40)
    parser.add_argument("--rate", type=float, default=10.0, help="events written per second")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--hold-seconds", type=float, default=10.0)
    parser.add_argument("--connect-window", type=int, default=200)
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--baseline-commit", default=BASELINE, help="the commit to compare with")
    parser.add_argument("--idle-baseline", action="store_true")
    parser.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of each variant")
    main_driver(parser.parse_args())


if __name__ == "__main__":
    main()
