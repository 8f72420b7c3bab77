"""The prompt is rendered from stored rows, never stored (``responses_app.prompting``):
what the web counts at submit and what the worker renders when the task runs
must be the same text, so both read the generation parameters in the order
PostgreSQL's ``jsonb`` gives them back."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from generation.params import GenerationParams
from generation.registry import get_model
from lmsp_core.ids import new_id
from responses_app.models import Response
from responses_app.prompting import as_stored, prompt_of, rendered

from .conftest import user_message

# Keys of several lengths, out of order, one of them not ASCII (bytes count).
SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string"}, "é": {"type": "integer"}, "id": {"enum": [1]}},
    "required": ["zone", "id"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "find", "description": "Finds.", "parameters": SCHEMA}


def test_as_stored_is_the_order_the_database_gives_back(db):
    params = GenerationParams(temperature=0.5, max_output_tokens=9, tools=[TOOL])
    owner = get_user_model().objects.create(username="ada")
    response = Response.objects.create(
        id=new_id("resp"), owner=owner, model="m", params=params.as_json()
    )
    read_back = Response.objects.get(id=response.id).params
    assert list(read_back["tools"][0]["parameters"]) != list(SCHEMA)  # jsonb reordered it
    assert list(read_back["tools"][0]["parameters"]["properties"]) == ["id", "é", "zone"]
    assert repr(as_stored(params.as_json())) == repr(read_back)


def test_the_prompt_counted_is_the_prompt_run(db):
    spec = get_model("smollm2:135m")
    params = GenerationParams(max_output_tokens=9, tools=[TOOL], tool_choice="required")
    owner = get_user_model().objects.create(username="ada")
    first = Response.objects.create(
        id=new_id("resp"),
        owner=owner,
        model=spec.id,
        input=[user_message("Find zone 4.")],
        output=[{"type": "message", "role": "assistant", "content": [{"text": "Done."}]}],
        params=params.as_json(),
        store=True,
    )
    counted = rendered(spec, first, [user_message("And zone 5?")], params)
    second = Response.objects.create(
        id=new_id("resp"),
        owner=owner,
        model=spec.id,
        input=[user_message("And zone 5?")],
        params=params.as_json(),
        previous_response=first,
    )
    run = prompt_of(Response.objects.get(id=second.id), spec)
    assert run == counted
    assert "Find zone 4." in run and "Done." in run and "And zone 5?" in run
    first.delete()
    alone = prompt_of(Response.objects.get(id=second.id), spec)
    assert "Find zone 4." not in alone and "Done." not in alone and "And zone 5?" in alone


pytestmark = pytest.mark.django_db
