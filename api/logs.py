"""Logs without secrets: a session id opens its conversation to whoever holds it, so no log line carries
one (issue 15). Every record's message, the service's own and uvicorn's access lines alike, has each
session-id-shaped token (32 URL-safe characters: secrets.token_urlsafe(24); a response id, "resp_" and
those) replaced by a short keyless tag, the same for the same id, so that an operator can still follow one
conversation through the log; key ids in /v1/admin/keys paths are dropped."""

from __future__ import annotations

import hashlib
import logging
import re

# A stored response's id ("resp_" and 32 characters) is one too: GET /v1/responses/{id} names its conversation
_ID = re.compile(r"(?<![A-Za-z0-9_-])(?:resp_)?[A-Za-z0-9_-]{32}(?![A-Za-z0-9_-])")
_KEY_PATH = re.compile(r"(/v1/admin/keys/)[^/?\s\"]+")


def _tag(match: re.Match) -> str:
    return "id:" + hashlib.blake2b(match.group().encode(), digest_size=4).hexdigest()


def redact(text: str) -> str:
    return _KEY_PATH.sub(r"\1…", _ID.sub(_tag, text))


def _redacted_arg(arg):
    """The argument itself (its type kept for the template's %d or %r), or its text redacted if it holds an id."""
    if arg is None or isinstance(arg, (int, float)):
        return arg
    text = str(arg)
    cleaned = redact(text)
    return arg if cleaned == text else cleaned


def _redacted_args(args):
    if isinstance(args, tuple):
        return tuple(_redacted_arg(arg) for arg in args)
    if isinstance(args, dict):
        return {key: _redacted_arg(value) for key, value in args.items()}
    return args


def redact_logs() -> None:
    """Makes every log record from now on carry its message redacted; installing it again does nothing."""
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "redacts", False):
        return

    def redacted_record(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        message = record.getMessage()
        if redact(message) != message:
            # The template and each argument apart: formatters read the arguments themselves (uvicorn's
            # AccessFormatter unpacks its five), so they stay where they are.
            record.msg = redact(record.msg) if isinstance(record.msg, str) else record.msg
            record.args = _redacted_args(record.args)
            message = record.getMessage()
            if redact(message) != message:  # an id made of template and argument together
                record.msg, record.args = redact(message), ()
        return record

    redacted_record.redacts = True
    logging.setLogRecordFactory(redacted_record)
