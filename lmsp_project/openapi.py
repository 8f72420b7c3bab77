"""``GET /lmsp/v1/openapi.json``: the hand-written OpenAPI 3.1 description of
the API (``openapi.yaml`` beside this file), served as JSON.

It lives in the composition root because it describes every app's
endpoints. Like every endpoint (contract, security) it needs a bearer
token; any valid token will do, whatever its scopes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from django.http import HttpRequest, JsonResponse

from accounts_app.services import authenticate_bearer
from lmsp_core.http import check_method, csrf_free, db_call

DESCRIPTION = Path(__file__).resolve().parent / "openapi.yaml"


@functools.cache
def description() -> dict[str, Any]:
    with DESCRIPTION.open() as file:
        loaded: dict[str, Any] = yaml.safe_load(file)
        return loaded


@csrf_free
async def openapi_json(request: HttpRequest) -> JsonResponse:
    check_method(request, ("GET", "HEAD"))
    await db_call(authenticate_bearer, request.headers.get("Authorization"))
    return JsonResponse(description())
