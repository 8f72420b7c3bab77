"""The text a model reads for a response, rendered from its conversation
whenever it is needed and never stored (issue "Security III").

A response keeps only its own input and output. The prompt of a turn that
continues a conversation (``previous_response_id``) is rendered from the
chain as it stands: by the web process when the request is submitted (its
length in tokens decides whether it fits, ``submit``), and again by the
worker when the task runs (``workers.runner``). So no row holds a copy of
another turn's words, and erasing a turn (``records.erase``) leaves them
nowhere: a later turn then continues from the first turn after the erased
one (its ``previous_response`` became empty), and a turn still queued when
an earlier one is erased runs without it.

Both renderings read the generation parameters in the order the database
gives them back: PostgreSQL's ``jsonb`` keeps no key order (it sorts keys
by length, then bytewise), so a tool's parameters or a JSON schema would
otherwise be written out in one order when the request is counted and in
another when it runs. In that order the grammar the worker compiles from
the stored parameters lists properties too.
"""

from __future__ import annotations

from typing import Any

from generation.params import GenerationParams
from generation.prompts import render_prompt
from generation.registry import ModelSpec
from generation.tokens import prompt_tokenizer

from .models import Response
from .selectors import conversation_items


def as_stored(value: Any) -> Any:
    """``value`` (JSON) with its objects' keys in the order ``jsonb`` gives them back."""
    if isinstance(value, dict):
        ordered = sorted(value, key=lambda key: (len(key.encode()), key.encode()))
        return {key: as_stored(value[key]) for key in ordered}
    if isinstance(value, list):
        return [as_stored(item) for item in value]
    return value


def rendered(
    spec: ModelSpec,
    previous: Response | None,
    input: list[dict[str, Any]],
    params: GenerationParams,
) -> str:
    """The prompt of a turn with ``input`` that continues ``previous`` (None: a
    conversation's first turn), as ``spec``'s chat template writes it."""
    context = (conversation_items(previous) if previous else []) + input
    stored = GenerationParams.from_json(as_stored(params.as_json()))
    return render_prompt(spec, prompt_tokenizer(spec), context, stored)


def prompt_of(response: Response, spec: ModelSpec) -> str:
    """What the model ``spec`` reads for ``response`` now: the turns of its
    conversation that remain, then its own input."""
    params = GenerationParams.from_json(response.params)
    return rendered(spec, response.previous_response, response.input, params)
