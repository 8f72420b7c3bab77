"""Locking a row that is created on first use (an owner's quota row, a
model's clock), in as few statements as the common case allows."""

from __future__ import annotations

from typing import TypeVar

from django.db.models import Model

M = TypeVar("M", bound=Model)


def locked_row(model: type[M], /, **key: object) -> M:
    """The row of ``model`` with ``key``, created with defaults if missing,
    locked (``FOR UPDATE``) until the transaction ends.

    One query when the row exists (nearly always: it is created once); else
    an insert that yields to a concurrent one, and the lock taken after it.
    """
    manager = model._default_manager
    locked = manager.select_for_update()
    row = locked.filter(**key).first()
    if row is None:
        manager.bulk_create([model(**key)], ignore_conflicts=True)
        row = locked.get(**key)
    return row
