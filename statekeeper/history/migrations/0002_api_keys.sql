-- API keys (statekeeper/tenancy.py) beside the history, for replicas that share it: a key created
-- through any replica, or `statekeeper keys` pointed at this database, works on every one. Only each
-- key's SHA-256 digest is stored, never the key.

CREATE TABLE api_keys (
    key_id text COLLATE "C" PRIMARY KEY,
    tenant text COLLATE "C" NOT NULL,
    created_at text NOT NULL,
    revoked boolean NOT NULL DEFAULT false,
    digest text NOT NULL
);
