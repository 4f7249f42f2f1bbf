-- The history's first schema (statekeeper/history/postgres.py applies each file once, in order, and
-- records it in schema_migrations). Client text (messages, system prompts, metadata) is stored as `json`
-- written by Python's json module: `json` keeps its text verbatim, so a NUL or a lone surrogate that a
-- client sent comes back exactly (PostgreSQL's `text` and `jsonb` refuse both).
-- Ids sort bytewise (COLLATE "C"), like LMDB keys: the admin table pages through them by range.

CREATE TABLE tenants (
    name text COLLATE "C" PRIMARY KEY,  -- "" is the one tenant of a service without API keys
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE conversations (
    id text COLLATE "C" PRIMARY KEY,
    tenant text COLLATE "C" NOT NULL REFERENCES tenants (name),
    created_at text NOT NULL,  -- as the service wrote it (ISO 8601)
    updated_at text,           -- when its last turn was committed
    system json,               -- a JSON string, or null
    metadata json,
    compression json,          -- per-conversation CompressionConfig overrides
    found_by_messages boolean NOT NULL DEFAULT false,
    tokens bytea NOT NULL,     -- the exact token ids fed to the model, int32 little-endian
    turns integer NOT NULL DEFAULT 0,          -- assistant messages: the compare-and-set of a turn's commit
    message_count integer NOT NULL DEFAULT 0,
    head bytea,                -- digest of its whole history (statekeeper/prefix_index.py), if indexed
    fence bigint               -- the newest lease fencing token a turn was committed with
);
CREATE INDEX conversations_by_tenant ON conversations (tenant);
CREATE INDEX conversations_by_head ON conversations (head) WHERE head IS NOT NULL;

CREATE TABLE messages (
    conversation_id text COLLATE "C" NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    position integer NOT NULL,
    role text NOT NULL,
    content json NOT NULL,     -- a JSON string
    PRIMARY KEY (conversation_id, position)
);

-- Every prefix of a conversation's history that ends with a reply: where a client that edited a later
-- turn branches off.
CREATE TABLE turn_prefixes (
    digest bytea NOT NULL,
    conversation_id text COLLATE "C" NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    PRIMARY KEY (digest, conversation_id)
);
CREATE INDEX turn_prefixes_by_conversation ON turn_prefixes (conversation_id);

-- Stored responses of OpenAI's Responses API.
CREATE TABLE responses (
    id text COLLATE "C" PRIMARY KEY,
    tenant text COLLATE "C" NOT NULL,
    conversation_id text COLLATE "C" NOT NULL,
    message_count integer NOT NULL,
    body json NOT NULL
);

-- Written by the health check: a store that cannot take a write is not healthy.
CREATE TABLE healthz (
    id integer PRIMARY KEY,
    checked_at timestamptz NOT NULL
);
