"""What the task lifecycle tells the apps built on it.

A task produces a response, but this app does not own responses: it announces
each change of a task's outcome, inside the transaction that makes it, and
the owner of the result (``responses_app.records``) writes its own rows (all
but the status, which the lifecycle moves with the task's:
``transitions.move_response``). Receivers run synchronously, so the task and
its result commit together.
"""

from django.dispatch import Signal

# A task reached a final status. Arguments: task, outcome (endings.Outcome).
task_finished = Signal()
# A failed task was queued again and its result starts over. Argument: task.
task_reopened = Signal()
