"""The model registry: what ``models.toml`` declares and this machine can serve."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from lmsp_core.errors import ProblemError

CAPABILITIES = frozenset({"tools", "structured_output", "reasoning", "conversations"})
SOURCES = frozenset({"gguf-package", "folder"})


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

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-zA-Z0-9]+", "-", self.id).strip("-").lower()

    @property
    def queue(self) -> str:
        """The Celery queue whose workers serve this model."""
        return f"{settings.LMSP_QUEUE_PREFIX}.{self.slug}"

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
        )
        unknown = set(spec.capabilities) - CAPABILITIES
        if spec.source not in SOURCES or unknown or spec.max_batch < 1:
            raise ValueError(f"models.toml: bad entry {spec.id!r} (source or {sorted(unknown)})")
        if spec.id in specs:
            raise ValueError(f"models.toml: {spec.id!r} is declared twice")
        specs[spec.id] = spec
    return specs


@functools.cache
def declared_models() -> dict[str, ModelSpec]:
    return parse_registry(Path(settings.LMSP_MODELS_FILE).read_text())


@functools.cache
def available_models() -> dict[str, ModelSpec]:
    """The declared models whose weights are present on this machine."""
    return {mid: spec for mid, spec in declared_models().items() if spec.source_location()}


def get_model(model_id: str, param: str = "model") -> ModelSpec:
    spec = available_models().get(model_id)
    if spec is None:
        raise ProblemError(
            "model_not_found", f"The model {model_id!r} does not exist.", param=param
        )
    return spec


def served_models() -> list[ModelSpec]:
    """The models this worker process serves (``LMSP_WORKER_MODELS``, default all)."""
    wanted = [m.strip() for m in settings.LMSP_WORKER_MODELS.split(",") if m.strip()]
    models = available_models()
    return [models[m] for m in wanted] if wanted else list(models.values())
