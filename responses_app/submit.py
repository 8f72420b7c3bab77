"""Submitting a generation: the one service behind ``POST /responses`` and
``POST /tasks``.

A validated request becomes everything a worker needs, checked now so that a
task never fails later for a reason the request already showed: the model
and its capabilities, the conversation it continues, the typed generation
parameters and the length of the rendered prompt. Then the response and its
task are stored together, once per idempotency key: the response with its
own input only, the prompt being rendered again when the task runs
(``prompting``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError

from generation.grammar_limits import CompilerBusy
from generation.params import GenerationParams
from generation.registry import ModelSpec, get_model
from generation.schemas import needs_grammar, schema_problem
from generation.tokens import prompt_tokenizer
from lmsp_core.errors import ProblemError
from tasks_app import budgets, idempotency, quotas, services
from tasks_app.models import Task, TaskKind

from . import prompting, records
from .models import Response
from .selectors import stored_response
from .serializers import validate_response_request


@dataclass(frozen=True)
class PreparedGeneration:
    spec: ModelSpec
    input: list[dict[str, Any]]
    previous: Response | None
    input_tokens: int
    params: GenerationParams
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
    owner: User, request: dict[str, Any], param_prefix: str = ""
) -> PreparedGeneration:
    """Everything a worker needs, from a validated request."""

    def at(name: str) -> str:
        return f"{param_prefix}.{name}" if param_prefix else name

    spec = get_model(request["model"], param=at("model"))
    params = GenerationParams.from_request(request)
    if params.tools:
        _require(spec, "tools", at("tools"))
    if params.json_schema is not None:
        _require(spec, "structured_output", at("response_format"))
    previous = None
    if "previous_response_id" in request:
        _require(spec, "conversations", at("previous_response_id"))
        previous = stored_response(
            owner, request["previous_response_id"], at("previous_response_id")
        )
    prompt = prompting.rendered(spec, previous, request["input"], params)
    # Counted only as far as the window: past it, the prompt is not encoded further.
    input_tokens = prompt_tokenizer(spec).count(prompt, limit=spec.context_window - 1)
    room = spec.context_window - input_tokens
    if room <= 0:
        raise ProblemError(
            "context_length_exceeded",
            f"The input is {spec.context_window} tokens or more; {spec.id!r} has a context "
            f"window of {spec.context_window}, with room needed for the answer.",
            param=at("input"),
        )
    # Compiling the grammar is the costly check: only for a request that fits,
    # and that its owner's quotas let through (they are checked again, under
    # the owner's lock, when the task is stored).
    if needs_grammar(params):
        quotas.refuse_if_over(owner.pk, input_tokens)
        try:
            unusable = schema_problem(params, spec)
        except CompilerBusy as exc:
            raise ProblemError(
                "overloaded",
                f"{exc}; retry shortly.",
                headers={"Retry-After": str(math.ceil(settings.LMSP_GRAMMAR_TIMEOUT_SECONDS))},
            ) from exc
        if unusable is not None:
            raise ProblemError("invalid_request", unusable[1], param=at(unusable[0]))
    wanted = request.get("max_output_tokens", spec.max_output_tokens)
    return PreparedGeneration(
        spec=spec,
        input=request["input"],
        previous=previous,
        input_tokens=input_tokens,
        params=params.limited(min(wanted, spec.max_output_tokens, room)),
        store=request["store"] and spec.has("conversations"),
    )


def start_generation(
    owner: User, prepared: PreparedGeneration, kind: str, token_id: int | None = None
) -> Task:
    """Store the response and the task that generates it, in one statement,
    which first locks the owner's row and checks its quotas (429), then the
    model's queue (503). ``token_id``: the token it was submitted with, which
    it runs only while usable (``tasks_app.entitlement``)."""
    response = records.new(
        owner,
        model=prepared.spec.id,
        input=prepared.input,
        params=prepared.params.as_json(),
        store=prepared.store,
        previous=prepared.previous,
        input_tokens=prepared.input_tokens,
    )
    try:
        return services.start_task(
            owner,
            prepared.spec,
            response,
            prepared.input_tokens,
            kind=kind,
            cost=prepared.params.max_output_tokens,
            follows=prepared.previous.pk if prepared.previous else None,
            token_id=token_id,
        )
    except IntegrityError as exc:
        if prepared.previous is None:
            raise
        # deleted between its lookup and this insert (DELETE /responses/{id})
        raise ProblemError(
            "response_not_found",
            f"No stored response with id {prepared.previous.pk!r}.",
            param="previous_response_id",
        ) from exc


# Per kind of task: the endpoint that creates it (idempotency keys are per
# endpoint) and where its request sits in the body (errors name that field).
ENDPOINTS: dict[str, tuple[str, str]] = {
    TaskKind.DIRECT: ("responses", ""),
    TaskKind.TASK: ("tasks", "request"),
}


def submit(
    owner: User,
    request: dict[str, Any],
    *,
    kind: str,
    idempotency_key: str | None,
    allowed_models: frozenset[str] | None,
    token_id: int | None = None,
) -> Task:
    """The task generating a validated request; with an ``Idempotency-Key``, the
    task of the first request that used the key (a retry starts nothing, and
    is charged nothing). ``allowed_models``: the models the caller may use
    (``tasks_app.model_access``; None: every one); any other is 404, before
    anything else, for a retry too. ``token_id``: the caller's token."""
    endpoint, param_prefix = ENDPOINTS[kind]
    get_model(
        request["model"],
        param=f"{param_prefix}.model" if param_prefix else "model",
        allowed=allowed_models,
    )

    def start() -> Task:
        prepared = prepare_generation(owner, request, param_prefix)
        return start_generation(owner, prepared, kind, token_id)

    if idempotency_key is None:
        return start()
    print_ = idempotency.fingerprint(endpoint, request)
    task = idempotency.start_once(owner, idempotency_key, print_, start)
    if task.replayed:
        task.budget_remaining = budgets.remaining_now(owner.pk)
    return task


def submit_task(
    owner: User,
    request: dict[str, Any],
    idempotency_key: str | None,
    allowed_models: frozenset[str] | None,
    token_id: int | None = None,
) -> Task:
    """``POST /tasks`` with ``"type": "response"`` (registered in ``apps``)."""
    body = {name: value for name, value in request.items() if name != "stream"}
    # a task is always followed through its events, whatever "stream" says
    validated = validate_response_request(body, prefix="request")
    return submit(
        owner,
        validated,
        kind=TaskKind.TASK,
        idempotency_key=idempotency_key,
        allowed_models=allowed_models,
        token_id=token_id,
    )
