-- Agent-reply resume evidence: admissions, starts, expiries and closures.
--
-- Each table is keyed by (run_id, suspension_id) - one pause, one record of each kind - and carries the
-- exact scope it was written under. None of them references the suspensions table: the evidence is
-- RETAINED after the live pause is deleted, because recovery (which admission may have started? which
-- expired?) is needed most exactly when the pause row is already gone.
--
-- schema_version is nullable on purpose: a row written before versions existed has none, and readers
-- take NULL as legacy version 0, never as invalid. Every new row is written with version 1.

CREATE TABLE resume_admissions (
    run_id            text NOT NULL REFERENCES runs (id),
    suspension_id     bigint NOT NULL,
    app               text NOT NULL,
    tenant            text NOT NULL,
    schema_version    integer CHECK (schema_version >= 1),
    -- The revision the request pinned (its ClaimVersion.run_revision), part of what request_digest binds.
    pinned_revision   bigint NOT NULL,
    -- The agent's reply exactly as received: bytea, so nothing can re-normalise its JSON. The 8 MiB limit
    -- counts the JSON-escaped size, which is never below the raw size, so this is a backstop only.
    input             bytea NOT NULL CHECK (octet_length(input) <= 8388608),
    request_digest    text NOT NULL,
    suspension_digest text NOT NULL,
    -- The run revision the claim produced.
    claimed_revision  bigint NOT NULL,
    admitted_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, suspension_id)
);
-- Exact-scope history (ListResumeAdmissions) and discovery (ListAgentReplyRuns), in run id order.
CREATE INDEX resume_admissions_by_scope ON resume_admissions (app, tenant, run_id COLLATE "C", suspension_id);

-- A start needs its admission: the grant of execution is meaningless without the claim it executes.
CREATE TABLE resume_starts (
    run_id          text NOT NULL,
    suspension_id   bigint NOT NULL,
    app             text NOT NULL,
    tenant          text NOT NULL,
    schema_version  integer CHECK (schema_version >= 1),
    pinned_revision bigint NOT NULL,
    request_digest  text NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, suspension_id),
    FOREIGN KEY (run_id, suspension_id) REFERENCES resume_admissions (run_id, suspension_id)
);

-- Start and expiry of one admission exclude each other. The store serialises both on the run's row lock
-- and each checks for the other under it; the tables alone cannot say "at most one of two".
CREATE TABLE resume_expiries (
    run_id          text NOT NULL,
    suspension_id   bigint NOT NULL,
    app             text NOT NULL,
    tenant          text NOT NULL,
    schema_version  integer CHECK (schema_version >= 1),
    pinned_revision bigint NOT NULL,
    request_digest  text NOT NULL,
    -- The run_events row written in the same transaction.
    event_id        uuid NOT NULL UNIQUE,
    -- The run's revision when the expiry was recorded (expiry does not change the run).
    run_revision    bigint NOT NULL,
    expired_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, suspension_id),
    FOREIGN KEY (run_id, suspension_id) REFERENCES resume_admissions (run_id, suspension_id)
);

-- Only a start can be uncertain, so only a start can be closed.
CREATE TABLE resume_closures (
    run_id         text NOT NULL,
    suspension_id  bigint NOT NULL,
    app            text NOT NULL,
    tenant         text NOT NULL,
    schema_version integer CHECK (schema_version >= 1),
    -- The frozen request as the closer checked it, returned on every identical retry.
    request        jsonb NOT NULL,
    request_digest text NOT NULL,
    event_id       uuid NOT NULL UNIQUE,
    -- The run's revision after the closure: the revision of the terminal state it wrote.
    run_revision   bigint NOT NULL,
    closed_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, suspension_id),
    FOREIGN KEY (run_id, suspension_id) REFERENCES resume_starts (run_id, suspension_id)
);
