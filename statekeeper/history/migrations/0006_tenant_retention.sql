-- Retention defaults an admin sets for a tenant at run time (PUT /v1/admin/tenants/{tenant}/retention), over
-- STATEKEEPER_TENANT_RETENTION's for that tenant; "*" holds every tenant's. Replicas read them in their sweep.
CREATE TABLE tenant_retention (
    tenant text COLLATE "C" PRIMARY KEY,
    retention json NOT NULL
);
