-- Retention controls (statekeeper/placement/retention.py): a conversation's own pin / priority / TTL for its
-- stored KV, null where it has none (its tenant's defaults apply).
ALTER TABLE conversations ADD COLUMN retention json;
