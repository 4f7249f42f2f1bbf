"""Logs without secrets: a session id opens its conversation to whoever holds it, so no log line carries
one (issue 15). Every record's message, the service's own and uvicorn's access lines alike, has each
session-id-shaped token (32 URL-safe characters: secrets.token_urlsafe(24)) replaced by a short keyless
tag, the same for the same id, so that an operator can still follow one conversation through the log; key
ids in /v1/admin/keys paths are dropped."""

from __future__ import annotations

import hashlib
import logging
import re

_ID = re.compile(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{32}(?![A-Za-z0-9_-])")
_KEY_PATH = re.compile(r"(/v1/admin/keys/)[^/?\s\"]+")


def _tag(match: re.Match) -> str:
    return "id:" + hashlib.blake2b(match.group().encode(), digest_size=4).hexdigest()


def redact(text: str) -> str:
    return _KEY_PATH.sub(r"\1…", _ID.sub(_tag, text))


def redact_logs() -> None:
    """Makes every log record from now on carry its message redacted; installing it again does nothing."""
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "redacts", False):
        return

    def redacted_record(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        return record

    redacted_record.redacts = True
    logging.setLogRecordFactory(redacted_record)
