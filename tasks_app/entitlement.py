"""Whether a task may still run: its token usable (not revoked, expired or
deleted), its owner active and its model still allowed to both
(``model_access``). The submit checked all three; a task can then wait in
its queue for minutes, and a revocation, a deactivation or a model taken
off a list must stop it as well as the streams it opened.

The check is SQL (``REFUSAL_SQL``), so that the claim reads it in the same
statement that picks the task (``fairness.fairest_sql``): a task that may
not run is never claimed, and ends failed with the reason
(``claims._end_refused``), unbilled. An operator's re-queue asks the same
(``refusal_of``). A task stored without a token (before 0009) is judged on
its owner and its model alone.
"""

from __future__ import annotations

import functools
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection

from accounts_app.models import ApiToken
from lmsp_core.errors import problem

from .models import OwnerQuota

OWNER_INACTIVE = "owner_inactive"
TOKEN_UNUSABLE = "token_unusable"
MODEL_NOT_ALLOWED = "model_not_allowed"


@functools.cache
def refusal_sql(task: str = "t") -> str:
    """An SQL expression: why the task row ``task`` (an alias) may not run
    now, one of the constants above, or NULL when it may."""
    users, tokens = get_user_model()._meta.db_table, ApiToken._meta.db_table
    return f"""(
    SELECT CASE
        WHEN NOT u.is_active THEN '{OWNER_INACTIVE}'
        WHEN {task}.token_id IS NOT NULL
             AND (k.id IS NULL OR k.revoked_at IS NOT NULL OR k.expires_at <= now())
            THEN '{TOKEN_UNUSABLE}'
        WHEN NOT coalesce(q.allowed_models @> to_jsonb({task}.model), true)
             OR NOT coalesce(k.allowed_models @> to_jsonb({task}.model), true)
            THEN '{MODEL_NOT_ALLOWED}'
    END
      FROM {users} AS u
      LEFT JOIN {tokens} AS k ON k.id = {task}.token_id
      LEFT JOIN {OwnerQuota._meta.db_table} AS q ON q.owner_id = {task}.owner_id
     WHERE u.id = {task}.owner_id
)"""


def refusal_of(task_id: str) -> str | None:
    """Why the task may not run now (``refusal_sql``); None when it may."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {refusal_sql()} FROM tasks_app_task AS t WHERE t.id = %s", [task_id]
        )
        row = cursor.fetchone()
    return row[0] if row else None


def refusal_problem(refusal: str, model: str) -> dict[str, Any]:
    """The error of a task that ended, never run, for ``refusal``."""
    if refusal == MODEL_NOT_ALLOWED:
        return problem(
            "model_not_found",
            f"The model {model!r} is no longer allowed to the token or the account that "
            "submitted this task; it was not run.",
            model=model,
        )
    if refusal == OWNER_INACTIVE:
        detail = "The account that submitted this task was deactivated"
    else:
        detail = "The token that submitted this task was revoked, has expired or was deleted"
    return problem("unauthorized", f"{detail}; it was not run.")
