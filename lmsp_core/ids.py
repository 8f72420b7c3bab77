"""Protocol ids: a prefix plus a ULID (contract section 1)."""

import re

from ulid import ULID

PREFIXES = ("resp", "msg", "fc", "call", "rs", "task")
_ULID = "[0-9A-HJKMNP-TV-Z]{26}"


def new_id(prefix: str) -> str:
    assert prefix in PREFIXES, prefix
    return f"{prefix}_{ULID()}"


def is_valid_id(value: object, prefix: str) -> bool:
    return isinstance(value, str) and re.fullmatch(f"{prefix}_{_ULID}", value) is not None
