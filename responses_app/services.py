"""Turning a validated request into a generation: context, prompt, limits."""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth.base_user import AbstractBaseUser

from workers.constraints import schema_problem
from workers.loading import load_tokenizer
from workers.prompts import count_tokens, render_prompt
from workers.registry import ModelSpec, get_model

from .errors import ProblemError
from .models import Response
from .selectors import conversation_items, stored_response


@dataclass(frozen=True)
class PreparedGeneration:
    spec: ModelSpec
    input: list[dict]
    previous: Response | None
    prompt: str
    input_tokens: int
    params: dict
    store: bool


def _require(spec: ModelSpec, capability: str, param: str) -> None:
    if not spec.has(capability):
        raise ProblemError(
            "unsupported_capability",
            f"The model {spec.id!r} does not have the {capability!r} capability.",
            param=param,
            capability=capability,
        )


def prepare_generation(
    owner: AbstractBaseUser, request: dict, param_prefix: str = ""
) -> PreparedGeneration:
    """Everything a worker needs, checked now so a task never fails later for
    a reason the request already showed."""

    def at(name: str) -> str:
        return f"{param_prefix}.{name}" if param_prefix else name

    spec = get_model(request["model"], param=at("model"))
    if request.get("tools"):
        _require(spec, "tools", at("tools"))
    response_format = request.get("response_format") or {"type": "text"}
    if response_format["type"] == "json_schema":
        _require(spec, "structured_output", at("response_format"))
    previous = None
    if "previous_response_id" in request:
        _require(spec, "conversations", at("previous_response_id"))
        previous = stored_response(
            owner, request["previous_response_id"], at("previous_response_id")
        )
    params = {
        "temperature": request["temperature"],
        "response_format": response_format,
        "tools": request.get("tools") or [],
        "tool_choice": request.get("tool_choice", "auto"),
    }
    unusable = schema_problem(params)
    if unusable is not None:
        raise ProblemError("invalid_request", unusable[1], param=at(unusable[0]))
    context = (conversation_items(previous) if previous else []) + request["input"]
    tokenizer = load_tokenizer(spec)
    prompt = render_prompt(spec, tokenizer, context, params)
    input_tokens = count_tokens(tokenizer, prompt)
    room = spec.context_window - input_tokens
    if room <= 0:
        raise ProblemError(
            "context_length_exceeded",
            f"The input is {input_tokens} tokens; {spec.id!r} has a context window of "
            f"{spec.context_window}, with room needed for the answer.",
            param=at("input"),
        )
    wanted = request.get("max_output_tokens", spec.max_output_tokens)
    params["max_output_tokens"] = min(wanted, spec.max_output_tokens, room)
    return PreparedGeneration(
        spec=spec,
        input=request["input"],
        previous=previous,
        prompt=prompt,
        input_tokens=input_tokens,
        params=params,
        store=request["store"] and spec.has("conversations"),
    )
