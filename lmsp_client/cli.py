"""The ``lmsp`` command: the client library for people and shell scripts.

``lmsp ask`` streams an answer to the terminal; ``lmsp task follow`` prints
a task's answer however often the connection drops, with a progress line on
stderr. ``--json`` prints machine-readable output instead (one JSON object,
or one JSON object per line for streams and lists), and the exit status says
how a generation ended (see ``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from ._common import Reconnect
from .client import Client
from .errors import EventHistoryExpiredError, LMSPError, ProblemError
from .events import (
    DELTA_TYPES,
    ErrorEvent,
    Event,
    OutputItemDone,
    OutputTextDelta,
    ReasoningSummaryTextDelta,
    output_text,
)

# Exit status per outcome: a generation's final status, or what went wrong.
EXIT_CODES = {
    "completed": 0,  # also: any command that is not a generation succeeded
    "error": 1,  # the service refused the request, or could not be reached
    "usage": 2,  # bad command line (argparse's own status)
    "incomplete": 3,  # generation stopped early (max_output_tokens)
    "failed": 4,
    "cancelled": 5,
}
INTERRUPTED = 130

EPILOG = """exit status: 0 completed (or success), 1 error, 2 usage, 3 incomplete,
4 failed, 5 cancelled, 130 interrupted.
environment: LMSP_BASE_URL (default http://127.0.0.1:8000), LMSP_TOKEN, LMSP_MODEL."""


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_usage(sys.stderr)
        return EXIT_CODES["usage"]
    try:
        with Client(args.base_url, args.token) as client:
            run: Callable[[Client, argparse.Namespace], int] = args.run
            return run(client, args)
    except EventHistoryExpiredError as error:
        _fail(error)
        return EXIT_CODES["error"]
    except ProblemError as error:
        if args.json:
            print(json.dumps(error.problem, ensure_ascii=False), file=sys.stdout)
        _fail(error)
        return EXIT_CODES["error"]
    except LMSPError as error:
        _fail(error)
        return EXIT_CODES["error"]
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return INTERRUPTED


def _fail(error: BaseException) -> None:
    print(f"lmsp: {error}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: given after the subcommand, an option overrides the global
    # one; not given, it leaves the global one alone.
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    common.add_argument("--base-url", default=argparse.SUPPRESS, help="or LMSP_BASE_URL")
    common.add_argument("--token", default=argparse.SUPPRESS, help="or LMSP_TOKEN")

    generation = argparse.ArgumentParser(add_help=False)
    generation.add_argument("text", help="the user message")
    generation.add_argument("--model", help="model id (default LMSP_MODEL or smollm2:135m)")
    generation.add_argument("--max-output-tokens", type=int)
    generation.add_argument("--temperature", type=float)
    generation.add_argument("--system", help="a system message before the user message")

    parser = argparse.ArgumentParser(
        prog="lmsp",
        description="Talk to an LMSP 1.0 service.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--base-url", help="service URL (or LMSP_BASE_URL)")
    parser.add_argument("--token", help="API token (or LMSP_TOKEN)")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    models = commands.add_parser("models", parents=[common], help="list the models")
    models.set_defaults(run=run_models)

    ask = commands.add_parser(
        "ask", parents=[common, generation], help="stream an answer to the terminal"
    )
    ask.set_defaults(run=run_ask)

    task = commands.add_parser("task", help="durable tasks: create, follow, cancel, list")
    tasks = task.add_subparsers(title="task commands", metavar="COMMAND")
    create = tasks.add_parser("create", parents=[common, generation], help="queue a generation")
    create.add_argument("--idempotency-key", help="a retry with the same key makes no second task")
    create.add_argument("--follow", action="store_true", help="then follow it")
    create.set_defaults(run=run_task_create)
    follow = tasks.add_parser(
        "follow", parents=[common], help="print a task's answer, resuming after any drop"
    )
    follow.add_argument("task_id")
    follow.add_argument("--after", type=int, default=0, help="resume after this event id")
    follow.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    follow.set_defaults(run=run_task_follow)
    cancel = tasks.add_parser("cancel", parents=[common], help="cancel a task")
    cancel.add_argument("task_id")
    cancel.set_defaults(run=run_task_cancel)
    listing = tasks.add_parser("list", parents=[common], help="the tasks, newest first")
    listing.add_argument("--status", help="only tasks in this status")
    listing.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    listing.set_defaults(run=run_task_list)
    return parser


def _generation_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "max_output_tokens": args.max_output_tokens,
        "temperature": args.temperature,
        "instructions": args.system,
    }


def _print_json(value: object) -> None:
    print(json.dumps(value, ensure_ascii=False), flush=True)


def _event_json(event: Event) -> dict[str, Any]:
    return {"id": event.id, "event": event.event_type, "data": event.to_data()}


# --- commands ----------------------------------------------------------------------


def run_models(client: Client, args: argparse.Namespace) -> int:
    models = client.models()
    if args.json:
        _print_json(models)
    else:
        for model in models:
            capabilities = ", ".join(model.get("capabilities") or [])
            window = model.get("context_window")
            print(f"{model['id']}\tcontext {window}\t{capabilities}")
    return 0


def run_ask(client: Client, args: argparse.Namespace) -> int:
    events = client.stream_response(args.text, **_generation_options(args))
    status = _print_events(events, args.json, sys.stdout)
    # a direct stream ends with its final event (the client raises otherwise)
    return EXIT_CODES["error"] if status is None else status


def run_task_create(client: Client, args: argparse.Namespace) -> int:
    task = client.create_task(
        args.text, idempotency_key=args.idempotency_key, **_generation_options(args)
    )
    if args.json:
        _print_json(task)
    else:
        print(task["id"], flush=True)
    if args.follow:
        args.task_id, args.after, args.quiet = task["id"], 0, False
        return run_task_follow(client, args)
    return 0


def run_task_follow(client: Client, args: argparse.Namespace) -> int:
    progress = Progress(sys.stderr, enabled=not args.quiet)
    shown: list[str] = []
    try:
        events = client.follow(args.task_id, after=args.after, on_reconnect=progress.reconnecting)
        status = _print_events(progress.counting(events), args.json, sys.stdout, shown)
    except EventHistoryExpiredError as error:
        progress.done()
        return _from_stored_result(client, args, error, "".join(shown))
    progress.done()
    if status is None:  # 204 at once: the task was already final, nothing after --after
        task = client.get_task(args.task_id)
        return EXIT_CODES.get(task["status"], EXIT_CODES["error"])
    return status


def _from_stored_result(
    client: Client, args: argparse.Namespace, error: EventHistoryExpiredError, shown: str
) -> int:
    """The events are gone: print the rest of the answer from the task itself."""
    print(f"lmsp: {error}", file=sys.stderr)
    task = client.get_task(args.task_id)
    if task.get("result") is None:
        return EXIT_CODES["error"]
    if args.json:
        _print_json(task)
    else:
        text = output_text(task["result"])
        if not text.startswith(shown):
            print("lmsp: the stored answer does not continue what was shown", file=sys.stderr)
            return EXIT_CODES["error"]
        sys.stdout.write(text[len(shown) :] + "\n")
    return EXIT_CODES.get(task["status"], EXIT_CODES["error"])


def run_task_cancel(client: Client, args: argparse.Namespace) -> int:
    task = client.cancel(args.task_id)
    if args.json:
        _print_json(task)
    else:
        print(f"{task['id']}\t{task['status']}")
    return 0


def run_task_list(client: Client, args: argparse.Namespace) -> int:
    if args.limit < 1:
        print("lmsp: --limit must be at least 1", file=sys.stderr)
        return EXIT_CODES["usage"]
    tasks = client.tasks(status=args.status, page_size=min(args.limit, 100))
    for count, task in enumerate(tasks, 1):
        if args.json:
            _print_json(task)
        else:
            print(f"{task['id']}\t{task['status']}\t{task['created_at']}\t{task['response_id']}")
        if count >= args.limit:
            break
    return 0


# --- output ------------------------------------------------------------------------


def _print_events(
    events: Iterable[Event], as_json: bool, out: TextIO, shown: list[str] | None = None
) -> int | None:
    """Print a stream (text, or JSON lines); the exit status of its final
    event, or None when there was no event at all."""
    status = None
    in_reasoning = False
    for event in events:
        if as_json:
            _print_json(_event_json(event))
        elif isinstance(event, ReasoningSummaryTextDelta):
            in_reasoning = True
            sys.stderr.write(event.delta)
        elif isinstance(event, OutputTextDelta):
            if in_reasoning:
                sys.stderr.write("\n")
                in_reasoning = False
            out.write(event.delta)
            out.flush()
            if shown is not None:
                shown.append(event.delta)
        elif isinstance(event, OutputItemDone) and event.item.get("type") == "function_call":
            item = event.item
            out.write(f"\n[function_call {item.get('name')}({item.get('arguments')})]")
        if event.is_final:
            status = _final_status(event)
            if not as_json:
                out.write("\n")
                out.flush()
                if isinstance(event, ErrorEvent) or event.event_type == "response.failed":
                    problem = event.data.get("error") or {}
                    print(f"lmsp: {problem.get('code')}: {problem.get('detail')}", file=sys.stderr)
    return status


def _final_status(event: Event) -> int:
    if isinstance(event, ErrorEvent):
        return EXIT_CODES["error"]
    status = event.data.get("status") or event.event_type.rsplit(".", 1)[-1]
    return EXIT_CODES.get(status, EXIT_CODES["error"])


class Progress:
    """The progress line of ``task follow`` on stderr: tokens so far (one
    delta event per token, as lmsp sends them), tokens/s, and
    ``reconnecting...`` while the follow resumes. On a terminal whose stdout
    is elsewhere it is one line redrawn in place; otherwise it writes whole
    lines, only for reconnects and at the end, so as not to break the text."""

    def __init__(self, stream: TextIO, *, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self.redraw = enabled and stream.isatty() and not sys.stdout.isatty()
        self.break_line = "\n" if stream.isatty() else ""
        self.tokens = 0
        self.started: float | None = None
        self.final_usage: dict[str, Any] | None = None
        self.last_draw = 0.0

    def counting(self, events: Iterable[Event]) -> Iterator[Event]:
        for event in events:
            if isinstance(event, DELTA_TYPES):
                self.started = self.started or time.monotonic()
                self.tokens += 1
                if self.redraw and time.monotonic() - self.last_draw > 0.2:
                    self._draw(self._line())
            if event.is_final:
                self.final_usage = event.data.get("usage")
            yield event

    def _rate(self) -> float:
        if self.started is None:
            return 0.0
        elapsed = time.monotonic() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def _line(self) -> str:
        return f"{self.tokens} tokens, {self._rate():.1f} tokens/s"

    def _draw(self, line: str) -> None:
        self.last_draw = time.monotonic()
        self.stream.write("\r\x1b[K" + line)
        self.stream.flush()

    def reconnecting(self, info: Reconnect) -> None:
        if not self.enabled:
            return
        line = (
            f"{self._line()}, reconnecting... (after event {info.last_event_id}, "
            f"attempt {info.attempt}, {type(info.error).__name__})"
        )
        if self.redraw:
            self._draw(line)
        else:
            # On a terminal that also shows the answer, start a line of our own.
            self.stream.write(f"{self.break_line}lmsp: {line}\n")
            self.stream.flush()

    def done(self) -> None:
        if not self.enabled:
            return
        line = self._line()
        if self.final_usage and "output_tokens" in self.final_usage:
            line += f" ({self.final_usage['output_tokens']} output tokens in all)"
        if self.redraw:
            self._draw(line)
            self.stream.write("\n")
        else:
            self.stream.write(f"{self.break_line}lmsp: {line}\n")
        self.stream.flush()


def entry_point() -> None:
    """The console script."""
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
