"""kombu's Redis transport, made to survive a Redis restart under the threads pool.

When Redis goes away, the worker's consumer closes its connection, and
kombu's ``Connection._do_close_transport`` sets the transport's ``client``
(the connection's parameters) to None. Something still needs them
afterwards: the closing channel restores its unacknowledged messages, and a
job thread acknowledges its message (``task_acks_late``), both through a
Redis client built from those parameters. They then raise
``AttributeError: 'NoneType' object has no attribute 'hostname'``, which
neither kombu nor Celery count as a connection error, and the model worker
died with every generation it held (seen with a PostgreSQL and a Redis
restart in a row; kombu issues #659 and #582 report the same class of race).

This transport keeps its parameters for good: those late calls then build a
client, which reaches the restarted Redis or fails with a connection error
that kombu and Celery handle as they do any other (log it, reconnect). Set as
``CELERY_BROKER_TRANSPORT`` for every process (the URL stays ``redis://``).
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis


class Transport(redis.Transport):
    """The Redis transport whose ``client`` is never reset to None."""

    @property
    def client(self) -> Any:
        return self._lmsp_client

    @client.setter
    def client(self, value: Any) -> None:
        if value is not None:  # closing drops it to break a cycle: keep it
            self._lmsp_client = value
