"""Model instances and rows, for hot paths written in SQL.

``Model.from_db`` takes the values as they come, but the ORM converts some
first: Django's connection reads ``jsonb`` as text, and a JSONField's value
is decoded by the field (``from_db_value``). ``from_row`` converts as the
ORM would, so that an instance read in SQL on Django's connection (a hot
path written once) is the instance the ORM would have built. (The streams'
own async pool decodes JSON itself: its rows need no conversion.)

``as_record`` goes the other way: an unsaved instance as the row ``save()``
would insert, so that a statement that inserts it among other things (a
submit: ``tasks_app.services.start_task``) writes what the ORM would.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar, cast

from django.db import connections
from django.db.models import Field, Model
from psycopg.types.json import Json, Jsonb

M = TypeVar("M", bound=Model)


def from_row(
    model: type[M], names: Sequence[str], values: Sequence[Any], alias: str = "default"
) -> M:
    """An instance of ``model`` with the fields ``names`` (attnames, in the
    order of ``values``) set from a row."""
    connection = connections[alias]
    converted = []
    for name, value in zip(names, values, strict=True):
        field = model._meta.get_field(name)
        if value is not None and hasattr(field, "from_db_value"):
            value = field.from_db_value(value, None, connection)
        converted.append(value)
    return model.from_db(alias, list(names), converted)


@functools.cache
def columns(model: type[Model]) -> list[str]:
    """The columns of ``model``'s fields, in the order of their attnames
    (``_meta.concrete_fields``), for a SELECT written in SQL."""
    return [field.column for field in model._meta.concrete_fields]


def _inserted_fields(model: type[Model]) -> list[Field[Any, Any]]:
    meta = model._meta
    return [field for field in meta.local_concrete_fields if field is not meta.auto_field]


def inserted_columns(model: type[Model]) -> list[str]:
    """The columns an INSERT of ``model`` writes: all but an auto-incremented key."""
    return [field.column for field in _inserted_fields(model)]


def as_record(obj: Model, alias: str = "default") -> str:
    """The row ``obj.save()`` would insert (defaults and ``pre_save`` applied,
    values prepared by their fields), as a JSON object keyed by column, for
    ``jsonb_populate_record``; an auto-incremented key is left out (the
    database numbers it)."""
    connection = connections[alias]
    items = []
    for field in _inserted_fields(type(obj)):
        value = field.get_db_prep_save(field.pre_save(obj, True), connection)
        encoded: str
        if isinstance(value, (Json, Jsonb)):  # a JSONField's, with the field's own encoder
            encoded = cast(str, (value.dumps or json.dumps)(value.obj))
        elif isinstance(value, datetime):
            encoded = json.dumps(value.isoformat())
        else:
            encoded = json.dumps(value)
        items.append(f"{json.dumps(field.column)}: {encoded}")
    return "{" + ", ".join(items) + "}"
