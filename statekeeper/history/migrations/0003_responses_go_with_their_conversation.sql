-- A stored response goes with the conversation it answered: deleting the conversation deletes it, on every
-- replica at once. Responses of conversations deleted before this migration are removed first.
DELETE FROM responses WHERE NOT EXISTS (SELECT 1 FROM conversations WHERE conversations.id = responses.conversation_id);
ALTER TABLE responses ADD CONSTRAINT responses_conversation_fkey
    FOREIGN KEY (conversation_id) REFERENCES conversations (id) ON DELETE CASCADE;
CREATE INDEX responses_by_conversation ON responses (conversation_id);
