"""``python -m lmsp_client``: the ``lmsp`` command without the console script."""

from .cli import entry_point

entry_point()
