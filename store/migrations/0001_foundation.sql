-- Foundation: runs, suspensions, checkpoints, progress, run events, the outbox and the inbox.
--
-- Every table carries app and tenant, and every statement that reads or writes a row names both: scope
-- is exact. Timestamps are timestamptz decided by the database clock, so "deadline passed" and "lease
-- lapsed" are judged by one clock, never by a worker's.

CREATE TYPE run_state AS ENUM ('created', 'running', 'paused', 'completed', 'failed', 'cancelled');
CREATE TYPE suspend_reason AS ENUM ('approval', 'external_tool', 'agent_reply');

CREATE TABLE runs (
    id                text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9_.:-]{1,128}$'),
    app               text NOT NULL CHECK (app ~ '^[A-Za-z0-9_-]{1,64}$'),
    tenant            text NOT NULL CHECK (tenant ~ '^[A-Za-z0-9_-]{1,64}$'),
    agent_id          text NOT NULL CHECK (length(agent_id) BETWEEN 1 AND 128),
    state             run_state NOT NULL DEFAULT 'created',
    -- Bumped by every state change; claims pin it.
    revision          bigint NOT NULL DEFAULT 0,
    lease_owner       text,
    lease_expires_at  timestamptz,
    input             text NOT NULL DEFAULT '',
    output            text,
    error             text,
    session_id        text NOT NULL DEFAULT '',
    config            jsonb NOT NULL DEFAULT '{}',
    script            jsonb,
    pause_ttl_seconds integer NOT NULL DEFAULT 0 CHECK (pause_ttl_seconds >= 0),
    -- Digest of the start request, so a repeated start is a no-op and a different one is run_exists.
    start_digest      text NOT NULL DEFAULT '',
    step_count        integer NOT NULL DEFAULT 0,
    tokens_used       bigint NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    ended_at          timestamptz,
    -- A half lease is never stored, and only a running run holds a lease.
    CONSTRAINT runs_whole_lease CHECK ((lease_owner IS NULL) = (lease_expires_at IS NULL)),
    CONSTRAINT runs_lease_only_running CHECK (lease_owner IS NULL OR state = 'running'),
    CONSTRAINT runs_lease_owner_not_empty CHECK (lease_owner IS NULL OR lease_owner <> '')
);

-- The reclaim sweep: running runs by lease expiry.
CREATE INDEX runs_running_by_lease ON runs (lease_expires_at) WHERE state = 'running';
CREATE INDEX runs_by_scope ON runs (app, tenant, id);

CREATE SEQUENCE suspension_ids;

CREATE TABLE suspensions (
    id            bigint PRIMARY KEY DEFAULT nextval('suspension_ids'),
    run_id        text NOT NULL REFERENCES runs (id),
    app           text NOT NULL,
    tenant        text NOT NULL,
    reason        suspend_reason NOT NULL,
    pending       jsonb NOT NULL DEFAULT '[]',
    continuation  jsonb NOT NULL,
    checkpoint_id bigint,
    approvers     text[] NOT NULL DEFAULT '{}',
    expires_at    timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now()
);
ALTER SEQUENCE suspension_ids OWNED BY suspensions.id;

-- At most one live pause per run.
CREATE UNIQUE INDEX suspensions_one_per_run ON suspensions (run_id);
-- The expiry sweep: pauses by deadline.
CREATE INDEX suspensions_by_deadline ON suspensions (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX suspensions_by_scope ON suspensions (app, tenant, reason, run_id);

CREATE TABLE checkpoints (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id        text NOT NULL REFERENCES runs (id),
    suspension_id bigint NOT NULL,
    app           text NOT NULL,
    tenant        text NOT NULL,
    approvers     text[] NOT NULL DEFAULT '{}',
    state         text NOT NULL DEFAULT 'pending'
                  CHECK (state IN ('pending', 'approved', 'denied', 'rejected')),
    decided_by    text,
    reason        text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    decided_at    timestamptz
);
CREATE INDEX checkpoints_pending_by_run ON checkpoints (run_id) WHERE state = 'pending';

CREATE TABLE progress (
    run_id       text PRIMARY KEY REFERENCES runs (id),
    app          text NOT NULL,
    tenant       text NOT NULL,
    owner        text NOT NULL CHECK (owner <> ''),
    continuation jsonb NOT NULL,
    started      jsonb NOT NULL DEFAULT '[]',
    done         jsonb NOT NULL DEFAULT '[]',
    ending       jsonb,
    updated_at   timestamptz NOT NULL DEFAULT now()
);

-- Metadata events, each written in the transaction of the state change it describes.
CREATE TABLE run_events (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id   uuid NOT NULL UNIQUE,
    run_id     text NOT NULL,
    app        text NOT NULL,
    tenant     text NOT NULL,
    kind       text NOT NULL,
    revision   bigint NOT NULL,
    data       jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX run_events_by_run ON run_events (run_id, id);

-- Events to publish, written in the transaction of the change that caused them. The relay publishes
-- them with confirms and marks them sent only after the confirm; message_id never changes, so
-- subscribers can deduplicate a re-publication.
CREATE TABLE outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id     uuid NOT NULL UNIQUE,
    routing_key    text NOT NULL,
    body           text NOT NULL,
    correlation_id text,
    headers        jsonb NOT NULL DEFAULT '{}',
    app            text NOT NULL,
    tenant         text NOT NULL,
    run_id         text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    sent_at        timestamptz
);
CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL;
CREATE INDEX outbox_by_run ON outbox (run_id, id);

-- Wake the relay when a transaction adds outbox rows (one notification per transaction: Postgres folds
-- identical payloads), so delivery does not wait for the poll.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('intermission_outbox', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

-- Each accepted command's message_id, body digest and outcome, written with its effect.
CREATE TABLE inbox (
    message_id  text PRIMARY KEY,
    routing_key text NOT NULL,
    body_digest text NOT NULL,
    outcome     text NOT NULL,
    app         text NOT NULL,
    tenant      text NOT NULL,
    run_id      text,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- The demo agent's ledger of non-retry-safe calls: one row per handler invocation. No unique constraint
-- on purpose: a call that ran twice must show up as two rows, not be hidden by an error.
CREATE TABLE demo_charges (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id     text NOT NULL,
    call_id    text NOT NULL,
    amount     numeric NOT NULL,
    charged_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX demo_charges_by_call ON demo_charges (run_id, call_id);
