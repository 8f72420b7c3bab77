"""``GET /lmsp/v1/openapi.json``: the hand-written OpenAPI 3.1 description of
the API (``openapi.yaml`` beside this file), served as JSON.

It lives in the composition root because it describes every app's
endpoints. It needs no token: it says nothing a client of the protocol
does not already know, and tools load it before they hold a token.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml
from django.http import HttpRequest, JsonResponse

from lmsp_core.http import check_method, csrf_free

DESCRIPTION = Path(__file__).resolve().parent / "openapi.yaml"


@functools.cache
def description() -> dict:
    with DESCRIPTION.open() as file:
        return yaml.safe_load(file)


@csrf_free
def openapi_json(request: HttpRequest) -> JsonResponse:
    check_method(request, ("GET", "HEAD"))
    return JsonResponse(description())
