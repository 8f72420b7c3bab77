"""Generation parameters: a validated request turned once into one typed value.

The web process builds it (``from_request``, where every default is filled
in), stores it on the response as JSON (``as_json``), and the worker reads it
back typed (``from_json``): prompts, grammars and the runner all read the
same fields and never guess a default of their own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

TEXT_FORMAT = {"type": "text"}


@dataclass(frozen=True)
class GenerationParams:
    temperature: float = 1.0  # 0 means greedy
    max_output_tokens: int = 0  # set by the web process from the model and the room left
    response_format: dict[str, Any] = field(default_factory=lambda: dict(TEXT_FORMAT))
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = (
        "auto"  # auto, none, required, or {"type": "function", "name"}
    )

    @classmethod
    def from_request(cls, request: dict[str, Any]) -> GenerationParams:
        """The parameters a validated request asks for; ``max_output_tokens``
        stays 0 until ``limited`` knows the model and the prompt's length."""
        return cls(
            temperature=request.get("temperature", cls.temperature),
            response_format=request.get("response_format") or dict(TEXT_FORMAT),
            tools=request.get("tools") or [],
            tool_choice=request.get("tool_choice", "auto"),
        )

    def limited(self, max_output_tokens: int) -> GenerationParams:
        return replace(self, max_output_tokens=max_output_tokens)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerationParams:
        return cls(**data)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The schema a ``json_schema`` answer must satisfy; None for free text."""
        if self.response_format["type"] != "json_schema":
            return None
        schema: dict[str, Any] = self.response_format["json_schema"]["schema"]
        return schema

    @property
    def forces_call(self) -> bool:
        """Whether the answer must be a tool call (``required`` or a named tool):
        then the model has nothing to decide but which call, and with what."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        )

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call a tool (the output parser looks for calls)."""
        return bool(self.tools) and self.tool_choice != "none"
