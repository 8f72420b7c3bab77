"""The model registry: what ``models.toml`` declares and this machine can serve."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import tomllib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from lmsp_core.errors import ProblemError

CAPABILITIES = frozenset({"tools", "structured_output", "reasoning", "conversations"})
SOURCES = frozenset({"gguf-package", "folder"})
DTYPES = frozenset({"auto", "float32", "bfloat16", "float16"})
ATTENTION_KERNELS = frozenset({"sdpa", "eager"})
LINEAR_KERNELS = frozenset({"auto", "packed", "torch"})
# Servers a model may be served by instead of a worker's own engine
# (``[models.upstream]``): "vllm" takes token ids in and gives them back, so a
# resumed generation continues token for token, and constrains output with
# xgrammar's structural tags; "openai", any other OpenAI-compatible
# completions server, is asked in text, continues text for text and
# constrains nothing, so its models may not offer tools or structured output
# (engine.upstream).
UPSTREAM_ENGINES = frozenset({"vllm", "openai"})
TEXT_ENGINES = frozenset({"openai"})  # asked in text: no grammar, no salt
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class UpstreamSpec:
    """An OpenAI-compatible server that generates for a model (``[models.upstream]``).

    The API key is read from the environment variable ``api_key_env`` when a
    request is sent: never stored, logged, or shown."""

    base_url: str  # up to /v1, e.g. http://vllm:8000/v1
    model: str  # the name the server serves it under (vLLM's --served-model-name)
    engine: str = "vllm"
    api_key_env: str = ""
    connect_timeout_seconds: float = 5.0
    # The longest wait for the next byte of an answer (a long prompt's prefill included).
    read_timeout_seconds: float = 120.0
    # While the server is down or refuses for now (5xx, 429), a task waits
    # queued, tried again after half the time it has waited (1 s at least,
    # retry_seconds at most), and fails once it has waited this long.
    unavailable_timeout_seconds: float = 600.0
    retry_seconds: float = 10.0


@dataclass(frozen=True)
class ModelSpec:
    id: str
    source: str
    context_window: int
    max_output_tokens: int
    capabilities: tuple[str, ...]
    tool_format: str = "hermes"
    # Generations one worker process decodes together (continuous batching).
    max_batch: int = 8
    package: str = ""
    file: str = ""
    path: str = ""
    # How a worker runs it (workers.loading): "auto" picks cuda when there is
    # one (bfloat16 there, float32 on a CPU).
    dtype: str = "auto"
    device: str = "auto"
    attention: str = "sdpa"
    # The linear layers' layout (engine.linear): "auto" on a CPU in float32
    # holds each weight packed for oneDNN (a prompt's chunks) and in blocks
    # (a decoding step's rows), elsewhere torch's own; "packed" holds
    # them packed alone (a worker that cannot pack fails to load it); "torch"
    # computes with F.linear over the weights as loaded.
    linear: str = "auto"
    # OpenMP threads of its engine on a CPU (0: every core, as vLLM's CPU
    # backend runs its model; workers.loading.engine_threads).
    cpu_threads: int = 0
    # Tokens of keys and values a worker holds for it, running requests and
    # prefix cache together (0: derived, see workers.loading); at least the
    # context window, so that any one request fits alone.
    kv_budget_tokens: int = 0
    # On a GPU without kv_budget_tokens: the share of its memory this model
    # may fill, weights included.
    gpu_memory_fraction: float = 0.85
    # Prompt tokens computed per decoding step (0: by device, workers.loading).
    prefill_chunk_tokens: int = 0
    prefix_cache: bool = True
    # Whether requests of different owners reuse each other's cached
    # prefixes (engine.client). Off, each owner's are their own: shared,
    # an owner learns how much of a prompt another owner sent (the cached
    # tokens of their usage, their first token's time), enough to guess it
    # one token at a time.
    share_prefix_cache: bool = False
    # Served by another server's engine: the worker loads only the tokenizer.
    upstream: UpstreamSpec | None = None

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-zA-Z0-9]+", "-", self.id).strip("-").lower()

    @property
    def queue(self) -> str:
        """The Celery queue whose workers serve this model."""
        return f"{settings.LMSP_QUEUE_PREFIX}.{self.slug}"

    def worker_queue(self, worker: str) -> str:
        """The queue of one worker's own jobs for this model: a conversation's
        next turn, sent where its earlier turns are cached."""
        return f"{self.queue}@{worker}"

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def source_location(self) -> Path | None:
        """Where the weights are on this machine, or None when they are missing."""
        if self.source == "gguf-package":
            spec = importlib.util.find_spec(self.package)
            if spec is None or not spec.submodule_search_locations:
                return None
            location = Path(next(iter(spec.submodule_search_locations)))
            return location if (location / self.file).is_file() else None
        path = os.path.expandvars(self.path)
        if "$" in path or not path or not Path(path, "config.json").is_file():
            return None
        return Path(path)


def parse_registry(text: str) -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for entry in tomllib.loads(text).get("models", []):
        spec = ModelSpec(
            id=entry["id"],
            source=entry["source"],
            context_window=int(entry["context_window"]),
            max_output_tokens=int(entry["max_output_tokens"]),
            capabilities=tuple(entry.get("capabilities", [])),
            tool_format=entry.get("tool_format", "hermes"),
            max_batch=int(entry.get("max_batch", ModelSpec.max_batch)),
            package=entry.get("package", ""),
            file=entry.get("file", ""),
            path=entry.get("path", ""),
            dtype=entry.get("dtype", ModelSpec.dtype),
            device=entry.get("device", ModelSpec.device),
            attention=entry.get("attention", ModelSpec.attention),
            linear=entry.get("linear", ModelSpec.linear),
            cpu_threads=int(entry.get("cpu_threads", ModelSpec.cpu_threads)),
            kv_budget_tokens=int(entry.get("kv_budget_tokens", ModelSpec.kv_budget_tokens)),
            gpu_memory_fraction=float(
                entry.get("gpu_memory_fraction", ModelSpec.gpu_memory_fraction)
            ),
            prefill_chunk_tokens=int(
                entry.get("prefill_chunk_tokens", ModelSpec.prefill_chunk_tokens)
            ),
            prefix_cache=_flag(entry, "prefix_cache", ModelSpec.prefix_cache),
            share_prefix_cache=_flag(entry, "share_prefix_cache", ModelSpec.share_prefix_cache),
            upstream=_upstream(entry),
        )
        problem = _bad_setting(spec)
        if problem:
            raise ValueError(f"models.toml: bad entry {spec.id!r}: {problem}")
        if spec.id in specs:
            raise ValueError(f"models.toml: {spec.id!r} is declared twice")
        specs[spec.id] = spec
    return specs


def _flag(entry: dict[str, object], name: str, default: bool) -> bool:
    """A true/false setting of an entry; anything else (``"false"``, a string
    that Python would call true) is refused."""
    value = entry.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(
            f"models.toml: bad entry {entry.get('id')!r}: {name} must be true or false"
        )
    return value


def _upstream(entry: dict[str, object]) -> UpstreamSpec | None:
    table = entry.get("upstream")
    if table is None:
        return None
    if not isinstance(table, dict) or not table.get("base_url") or not table.get("model"):
        raise ValueError(
            f"models.toml: bad entry {entry.get('id')!r}: upstream needs base_url and model"
        )
    unknown = set(table) - {field.name for field in dataclasses.fields(UpstreamSpec)}
    if unknown:
        raise ValueError(
            f"models.toml: bad entry {entry.get('id')!r}: "
            f"unknown upstream settings {sorted(unknown)}"
        )
    default = UpstreamSpec("", "")
    return UpstreamSpec(
        base_url=str(table["base_url"]).rstrip("/"),
        model=str(table["model"]),
        engine=str(table.get("engine", default.engine)),
        api_key_env=str(table.get("api_key_env", "")),
        connect_timeout_seconds=float(
            table.get("connect_timeout_seconds", default.connect_timeout_seconds)
        ),
        read_timeout_seconds=float(table.get("read_timeout_seconds", default.read_timeout_seconds)),
        unavailable_timeout_seconds=float(
            table.get("unavailable_timeout_seconds", default.unavailable_timeout_seconds)
        ),
        retry_seconds=float(table.get("retry_seconds", default.retry_seconds)),
    )


def _bad_setting(spec: ModelSpec) -> str | None:
    unknown = set(spec.capabilities) - CAPABILITIES
    checks = [
        (spec.source in SOURCES, f"source {spec.source!r}"),
        (not unknown, f"capabilities {sorted(unknown)}"),
        (spec.max_batch >= 1, "max_batch below 1"),
        (spec.dtype in DTYPES, f"dtype {spec.dtype!r} (one of {sorted(DTYPES)})"),
        (bool(_DEVICE.fullmatch(spec.device)), f"device {spec.device!r} (auto, cpu, cuda:N)"),
        (spec.attention in ATTENTION_KERNELS, f"attention {spec.attention!r}"),
        (
            spec.linear in LINEAR_KERNELS,
            f"linear {spec.linear!r} (one of {sorted(LINEAR_KERNELS)})",
        ),
        (spec.cpu_threads >= 0, "cpu_threads below 0"),
        (
            spec.kv_budget_tokens == 0 or spec.kv_budget_tokens >= spec.context_window,
            "kv_budget_tokens below the context window (a request must fit alone)",
        ),
        (0 < spec.gpu_memory_fraction <= 1, "gpu_memory_fraction outside (0, 1]"),
        (spec.prefill_chunk_tokens >= 0, "prefill_chunk_tokens below 0"),
        *_bad_upstream(spec),
    ]
    return next((problem for ok, problem in checks if not ok), None)


def _bad_upstream(spec: ModelSpec) -> list[tuple[bool, str]]:
    upstream = spec.upstream
    if upstream is None:
        return []
    return [
        (
            upstream.engine in UPSTREAM_ENGINES,
            f"upstream engine {upstream.engine!r} (vllm or openai)",
        ),
        (
            upstream.engine not in TEXT_ENGINES
            or not {"tools", "structured_output"} & set(spec.capabilities),
            f"capabilities tools and structured_output with upstream engine "
            f"{upstream.engine!r}, which cannot constrain output (vllm can)",
        ),
        (
            min(
                upstream.connect_timeout_seconds,
                upstream.read_timeout_seconds,
                upstream.unavailable_timeout_seconds,
                upstream.retry_seconds,
            )
            > 0,
            "upstream timeouts must be positive",
        ),
    ]


@functools.cache
def declared_models() -> dict[str, ModelSpec]:
    return parse_registry(Path(settings.LMSP_MODELS_FILE).read_text())


@functools.cache
def available_models() -> dict[str, ModelSpec]:
    """The declared models whose weights are present on this machine."""
    return {mid: spec for mid, spec in declared_models().items() if spec.source_location()}


def get_model(
    model_id: str, param: str = "model", allowed: Collection[str] | None = None
) -> ModelSpec:
    """The model ``model_id``, or 404 ``model_not_found``. ``allowed``: the
    ids the caller may use (None: every one); a model outside it answers
    exactly as one that does not exist, so that a caller learns nothing of
    the models it may not use."""
    spec = available_models().get(model_id)
    if spec is None or (allowed is not None and model_id not in allowed):
        raise ProblemError(
            "model_not_found", f"The model {model_id!r} does not exist.", param=param
        )
    return spec


def listed_models(allowed: Collection[str] | None = None) -> list[ModelSpec]:
    """The available models a caller may use (``allowed``; None: every one)."""
    models = available_models().values()
    return [spec for spec in models if allowed is None or spec.id in allowed]


def served_models() -> list[ModelSpec]:
    """The models this worker process serves (``LMSP_WORKER_MODELS``, default all)."""
    wanted = [m.strip() for m in settings.LMSP_WORKER_MODELS.split(",") if m.strip()]
    models = available_models()
    return [models[m] for m in wanted] if wanted else list(models.values())
