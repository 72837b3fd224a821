-- The fleet: approvals carried by progress snapshots, and the sessions runs save their messages into.

-- Pending calls an approval decision granted, carried by the claim's first snapshot.
ALTER TABLE progress ADD COLUMN approved jsonb NOT NULL DEFAULT '[]';

-- A session's conversation. A run appends only its OWN messages (those from new_messages_from on), in
-- the transaction that ends it, so a resumed run can never write its loaded history back twice.
CREATE TABLE session_messages (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id text NOT NULL,
    app        text NOT NULL,
    tenant     text NOT NULL,
    run_id     text NOT NULL,
    message    jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX session_messages_by_session ON session_messages (app, tenant, session_id, id);
