-- Tool calls (OpenAI's `tools`): an assistant message may carry the calls it made, a `tool` message names
-- the call it answers, and a conversation keeps the functions its last turn offered the model and the chat
-- template variables it rendered with (`chat_template_kwargs`), so that the next turn's prompt renders the
-- same way. All are absent (null) for plain chat.
ALTER TABLE messages ADD COLUMN tool_fields json;      -- {"tool_calls": [...]} or {"tool_call_id": "..."}
ALTER TABLE conversations ADD COLUMN tools json;
ALTER TABLE conversations ADD COLUMN template_options json;
