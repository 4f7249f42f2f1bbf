"""Finding a conversation by what a client resends: digests of message-list prefixes.

OpenAI-style clients resend the whole conversation on every turn. Each stored conversation is indexed
by the digest of its whole history as chat messages (its "head", kept by the history store beside the
conversation, in the same transaction); a request's messages are digested prefix by prefix in one pass,
and the longest prefix that is some conversation's head names the conversation to continue. A digest
only proposes: the caller compares the stored messages with the request's before any KV is used, and
the turn then checks the exact token history as every turn does (ChatFormatter.extend).

Digests are keyed BLAKE2b: the key separates tenants, so the same messages sent by two tenants never
meet in the index, and without the service's secret nobody can compute an entry's digest."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

DIGEST_BYTES = 32


def _encoded(message: dict) -> bytes:
    # One JSON array per message: its role and text, nothing a client may send differently each time, and
    # where present the calls it made or the call it answers (absent ones add nothing: plain messages keep
    # the digests they had before tool calls were stored).
    fields = [message["role"], message["content"]]
    if "tool_calls" in message or "tool_call_id" in message:
        fields += [message.get("tool_calls"), message.get("tool_call_id")]
    return json.dumps(fields, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass") + b"\n"


def tenant_key(index_key: bytes, tenant: str) -> bytes:
    """The digest key of one tenant's conversations: derived from the service's, so no two tenants share."""
    return hashlib.blake2b(tenant.encode(), digest_size=DIGEST_BYTES, key=index_key, person=b"sk-tenant").digest()


def prefix_digests(key: bytes, messages: Sequence[dict]) -> list[bytes]:
    """The digest of messages[:i + 1] for every i, computed in one pass over the messages."""
    running = hashlib.blake2b(digest_size=DIGEST_BYTES, key=key)
    digests = []
    for message in messages:
        running.update(_encoded(message))
        digests.append(running.copy().digest())
    return digests


def turn_prefixes(key: bytes, messages: Sequence[dict]) -> list[bytes]:
    """The digests of the conversation's prefixes that end with a reply: where a client that edits or
    drops a later message branches off, sharing everything before it (sessions/resend.py)."""
    return [digest for digest, message in zip(prefix_digests(key, messages), messages) if message["role"] == "assistant"]


def head_digest(key: bytes, messages: Sequence[dict]) -> bytes | None:
    """The digest a conversation with these chat messages is found by; None (not indexed) until it has a
    reply: an empty or system-only conversation is no state worth finding, and a client's fresh session
    must not be continued by someone else's first message."""
    if not any(message["role"] == "assistant" for message in messages):
        return None
    return prefix_digests(key, messages)[-1]
