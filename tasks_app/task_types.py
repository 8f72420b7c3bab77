"""Task types: what ``POST /tasks`` can start (contract section 6).

A task's body names its type (``{"type": "response", "request": {...}}``).
The app that owns that kind of work registers how to start one when Django
starts (``responses_app`` registers ``response``), so this app queues, runs
and streams tasks without importing what they produce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth.models import User

from .models import Task

# (owner, the body's "request" object, the Idempotency-Key or None, the models
# the caller may use or None for all: ``model_access``, the caller's token's
# id: ``Task.token``) -> the task
Starter = Callable[[User, dict[str, Any], str | None, frozenset[str] | None, int | None], Task]

_starters: dict[str, Starter] = {}


def register(type_name: str, start: Starter) -> None:
    _starters[type_name] = start


def names() -> list[str]:
    return sorted(_starters)


def starter(type_name: str) -> Starter:
    return _starters[type_name]
