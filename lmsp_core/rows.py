"""Model instances from rows read with hand-written SQL.

``Model.from_db`` takes the values as they come, but the ORM converts some
first: Django's connection reads ``jsonb`` as text, and a JSONField's value
is decoded by the field (``from_db_value``). ``from_row`` converts as the
ORM would, so that an instance read in SQL on Django's connection (a hot
path written once) is the instance the ORM would have built. (The streams'
own async pool decodes JSON itself: its rows need no conversion.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from django.db import connections
from django.db.models import Model

M = TypeVar("M", bound=Model)


def from_row(model: type[M], names: Sequence[str], values: Sequence, alias: str = "default") -> M:
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
