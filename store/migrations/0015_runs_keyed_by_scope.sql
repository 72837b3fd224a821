-- A run id is unique within its scope (app, tenant), not across scopes: this migration CHANGES KEYS.
--
-- Keyed by id alone (0001), a run id was global: a tenant that started run "r1" when another tenant already
-- had one was refused run_exists, which told it that the other tenant holds that id (and let it take
-- predictable ids first, so that the other tenant's starts under them were refused). The caller picks run
-- ids, so no tenant can be asked to avoid the others'. Now runs are keyed by (app, tenant, id), and so is
-- everything that names a run: two scopes may each have a run "r1", and neither ever touches the other's.
-- Within one scope nothing changes: the same start again is a no-op, another one under that id run_exists.
--
-- What changes:
--   * runs: PRIMARY KEY (app, tenant, id). runs_by_scope, which held exactly those columns, goes (the key
--     serves its readers). No index of runs leads with the id alone any more: on a table not analysed yet
--     the planner takes a one-column index on id for as cheap as the key, and walks every scope's run of
--     that id on each claim and end (tests/integration/test_planner_proof.py). So runs_running, the
--     reclaim sweep's index of running runs, holds their key instead of their id, and operators' lookup of
--     an id in every scope (`runs show RUN`) walks the key scope by scope (find_run_scopes).
--   * progress: PRIMARY KEY (app, tenant, run_id); suspensions_one_per_run UNIQUE (app, tenant, run_id);
--     resume_admissions, _starts, _expiries, _closures: PRIMARY KEY (app, tenant, run_id, suspension_id);
--     each foreign key that named runs (id) or an admission or start by (run_id, suspension_id) names the
--     whole key now, so no row can hang off another scope's run of the same id.
--   * the indexes that led with run_id alone lead with the scope and run_id: checkpoints_pending_by_run,
--     run_events_by_run, outbox_by_run, demo_charges_by_call.
--   * demo_charges gains app and tenant, filled from each charge's run.
--   * every transition function that named a run by id alone anywhere in its body is replaced, with the
--     same signature and the same outcomes (below): workers of the previous release, which call the very
--     same functions with the very same arguments during a rolling deploy, get the scoped behaviour too.
--
-- No row is lost. Every table but demo_charges carries app and tenant already, written by the transitions
-- from the run's own row. Before anything changes, this checks that each row of a table keyed to a run has
-- its run's scope (the old foreign keys named the run by id alone, so nothing in the schema said so), and
-- that each demo charge has a run; a row that does not (none that Intermission writes) stops the migration
-- with a message naming the table, rather than being moved to a scope or dropped. Until now an id named
-- one run, so filling demo_charges' scope from runs by id is unambiguous.
--
-- What it costs: it is one transaction (migrate.py runs each file in one), and ALTER TABLE takes an ACCESS
-- EXCLUSIVE lock on each table it changes, held to the commit: every table of runs is unreadable and
-- unwritable until the whole file has run, so workers' transitions wait (they do not fail) for that long.
-- The work is a sort per key and index rebuilt (runs' key and its running runs, progress, the four resume
-- tables, suspensions, the pending checkpoints, run_events, outbox, demo_charges), one pass over each
-- referencing table per foreign key and per scope check, and a rewrite of demo_charges; it grows with the
-- tables' sizes (a little faster than linearly), ended runs and unpruned history included. Measured on the
-- project's machine (PostgreSQL 15, two cores; docs/operations.md, "Run ids within a scope"): 10 to 12 s
-- for 200,000 runs with 600,000 run events, 400,000 outbox rows, 200,000 each of inbox records,
-- admissions, starts, closures, session messages and demo charges, and 50,000 pauses, checkpoints and
-- snapshots (585 MB in all); 4 to 6 s for half of that. Prune what retention allows first (`intermission
-- prune`) and apply it when few commands are in flight.

-- The rows of run-keyed tables whose scope is not their run's, and the demo charges without a run: either
-- stops the migration (see above).
DO $$
DECLARE
    v_table text;
    v_n bigint;
BEGIN
    FOREACH v_table IN ARRAY ARRAY['suspensions', 'checkpoints', 'progress', 'resume_admissions', 'resume_starts',
                                   'resume_expiries', 'resume_closures'] LOOP
        EXECUTE format('SELECT count(*) FROM %I x JOIN runs r ON r.id = x.run_id '
                       'WHERE (x.app, x.tenant) IS DISTINCT FROM (r.app, r.tenant)', v_table)
           INTO v_n;
        IF v_n > 0 THEN
            RAISE EXCEPTION '% row(s) of % name a run of another scope than their own', v_n, v_table
                  USING HINT = format('find them with: SELECT x.* FROM %I x JOIN runs r ON r.id = x.run_id '
                                      'WHERE (x.app, x.tenant) IS DISTINCT FROM (r.app, r.tenant); '
                                      'Intermission never writes one: mend or remove them, then migrate again',
                                      v_table);
        END IF;
    END LOOP;
    SELECT count(*) INTO v_n FROM demo_charges c WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = c.run_id);
    IF v_n > 0 THEN
        RAISE EXCEPTION '% demo charge(s) name no run, so their scope cannot be known', v_n
              USING HINT = 'find them with: SELECT c.* FROM demo_charges c WHERE NOT EXISTS '
                           '(SELECT 1 FROM runs r WHERE r.id = c.run_id); pruning removes a run''s charges '
                           'with it, so only a charge written by hand can be one: remove them, then migrate again';
    END IF;
END;
$$;

-- The demo ledger carries its run's scope, like every other table.
ALTER TABLE demo_charges ADD COLUMN app text, ADD COLUMN tenant text;
UPDATE demo_charges c SET app = r.app, tenant = r.tenant FROM runs r WHERE r.id = c.run_id;
ALTER TABLE demo_charges ALTER COLUMN app SET NOT NULL, ALTER COLUMN tenant SET NOT NULL;
DROP INDEX demo_charges_by_call;
CREATE INDEX demo_charges_by_call ON demo_charges (app, tenant, run_id, call_id);

-- The foreign keys that named a run by id (or an admission or start by run id and pause) go first: the keys
-- they reference are replaced.
ALTER TABLE resume_closures DROP CONSTRAINT resume_closures_run_id_suspension_id_fkey;
ALTER TABLE resume_expiries DROP CONSTRAINT resume_expiries_run_id_suspension_id_fkey;
ALTER TABLE resume_starts DROP CONSTRAINT resume_starts_run_id_suspension_id_fkey;
ALTER TABLE resume_admissions DROP CONSTRAINT resume_admissions_run_id_fkey;
ALTER TABLE suspensions DROP CONSTRAINT suspensions_run_id_fkey;
ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_run_id_fkey;
ALTER TABLE progress DROP CONSTRAINT progress_run_id_fkey;

ALTER TABLE runs DROP CONSTRAINT runs_pkey;
ALTER TABLE runs ADD CONSTRAINT runs_pkey PRIMARY KEY (app, tenant, id);
DROP INDEX runs_by_scope;
-- The reclaim sweep reads the running runs whatever the index holds; a lease renewal changes none of it.
DROP INDEX runs_running;
CREATE INDEX runs_running ON runs (app, tenant, id) WHERE state = 'running';

ALTER TABLE progress DROP CONSTRAINT progress_pkey;
ALTER TABLE progress ADD CONSTRAINT progress_pkey PRIMARY KEY (app, tenant, run_id);

-- At most one live pause per run: per run of a scope.
DROP INDEX suspensions_one_per_run;
CREATE UNIQUE INDEX suspensions_one_per_run ON suspensions (app, tenant, run_id);

ALTER TABLE resume_admissions DROP CONSTRAINT resume_admissions_pkey;
ALTER TABLE resume_admissions ADD CONSTRAINT resume_admissions_pkey PRIMARY KEY (app, tenant, run_id, suspension_id);
ALTER TABLE resume_starts DROP CONSTRAINT resume_starts_pkey;
ALTER TABLE resume_starts ADD CONSTRAINT resume_starts_pkey PRIMARY KEY (app, tenant, run_id, suspension_id);
ALTER TABLE resume_expiries DROP CONSTRAINT resume_expiries_pkey;
ALTER TABLE resume_expiries ADD CONSTRAINT resume_expiries_pkey PRIMARY KEY (app, tenant, run_id, suspension_id);
ALTER TABLE resume_closures DROP CONSTRAINT resume_closures_pkey;
ALTER TABLE resume_closures ADD CONSTRAINT resume_closures_pkey PRIMARY KEY (app, tenant, run_id, suspension_id);

ALTER TABLE suspensions
    ADD CONSTRAINT suspensions_run_fkey FOREIGN KEY (app, tenant, run_id) REFERENCES runs (app, tenant, id);
ALTER TABLE checkpoints
    ADD CONSTRAINT checkpoints_run_fkey FOREIGN KEY (app, tenant, run_id) REFERENCES runs (app, tenant, id);
ALTER TABLE progress
    ADD CONSTRAINT progress_run_fkey FOREIGN KEY (app, tenant, run_id) REFERENCES runs (app, tenant, id);
ALTER TABLE resume_admissions
    ADD CONSTRAINT resume_admissions_run_fkey FOREIGN KEY (app, tenant, run_id) REFERENCES runs (app, tenant, id);
ALTER TABLE resume_starts
    ADD CONSTRAINT resume_starts_admission_fkey FOREIGN KEY (app, tenant, run_id, suspension_id)
    REFERENCES resume_admissions (app, tenant, run_id, suspension_id);
ALTER TABLE resume_expiries
    ADD CONSTRAINT resume_expiries_admission_fkey FOREIGN KEY (app, tenant, run_id, suspension_id)
    REFERENCES resume_admissions (app, tenant, run_id, suspension_id);
ALTER TABLE resume_closures
    ADD CONSTRAINT resume_closures_start_fkey FOREIGN KEY (app, tenant, run_id, suspension_id)
    REFERENCES resume_starts (app, tenant, run_id, suspension_id);

-- The lookups of a run's rows by its key, led by the scope and the run id (none led by the scope alone:
-- migration 0010).
DROP INDEX checkpoints_pending_by_run;
CREATE INDEX checkpoints_pending_by_run ON checkpoints (app, tenant, run_id) WHERE state = 'pending';
DROP INDEX run_events_by_run;
CREATE INDEX run_events_by_run ON run_events (app, tenant, run_id, id);
DROP INDEX outbox_by_run;
CREATE INDEX outbox_by_run ON outbox (app, tenant, run_id, id);

-- The transitions, with their bodies keyed by the whole run key. Released functions are otherwise never
-- edited (a changed transition is a new _v2 beside the old, docs/decisions.md), but these are not changed
-- transitions: each keeps its signature, its outcomes and its effect on the run it names, and only stops
-- reaching rows of another scope's run of the same id. Leaving the old bodies for the previous release
-- would not keep that release working either: their ON CONFLICT (id) and (run_id) name keys that are gone,
-- and their deletes by run id alone would remove another scope's pause or progress. Sessions that cached a
-- function's old body compile the new one at their next call (plpgsql checks the function's row).
-- Already keyed by (app, tenant, id) in every statement, and so unchanged: intermission_save_progress_v1,
-- _recorded_command_v1, _create_pause_v1, _admit_resume_v1, _start_run_v2, _move_deadline_v1.

CREATE OR REPLACE FUNCTION intermission_write_progress_v1(
    p_run_id text, p_app text, p_tenant text, p_owner text,
    p_continuation jsonb, p_started jsonb, p_done jsonb, p_ending jsonb, p_approved jsonb
) RETURNS timestamptz LANGUAGE plpgsql AS $$
DECLARE
    v_updated_at timestamptz;
BEGIN
    INSERT INTO progress AS p (run_id, app, tenant, owner, continuation, started, done, ending, approved,
                               updated_at)
    VALUES (p_run_id, p_app, p_tenant, p_owner, p_continuation, COALESCE(p_started, '[]'),
            COALESCE(p_done, '[]'), p_ending, COALESCE(p_approved, '[]'), now())
    ON CONFLICT (app, tenant, run_id) DO UPDATE
       SET owner = excluded.owner, continuation = excluded.continuation, started = excluded.started,
           done = excluded.done, ending = COALESCE(p.ending, excluded.ending), approved = excluded.approved,
           updated_at = excluded.updated_at
    RETURNING p.updated_at INTO v_updated_at;
    RETURN v_updated_at;
END;
$$;

CREATE OR REPLACE FUNCTION intermission_claim_pause_v1(
    p_run_id text, p_app text, p_tenant text,
    p_suspension_id bigint, p_revision bigint,
    p_expired_by timestamptz, p_reason suspend_reason,
    p_lease_owner text, p_lease_ttl float8,
    p_first boolean, p_first_continuation jsonb, p_first_started jsonb, p_first_done jsonb,
    p_first_ending jsonb, p_first_approved jsonb,
    p_drop_pause boolean,
    p_message_id text, p_routing_key text, p_digest text,
    p_checkpoint_id bigint, p_checkpoint_state text, p_decided_by text, p_decision_reason text,
    p_event_message_id uuid, p_event_routing_key text, p_event_body text, p_event_correlation_id text,
    p_event_headers jsonb,
    p_rows boolean,
    OUT outcome text, OUT revision bigint, OUT lease_owner text, OUT lease_expires_at timestamptz,
    OUT updated_at timestamptz, OUT suspension_id bigint, OUT expires_at timestamptz,
    OUT first_updated_at timestamptz, OUT run runs, OUT pause suspensions
) LANGUAGE plpgsql AS $$
DECLARE
    v_revision bigint := p_revision;
    v_claim record;
BEGIN
    IF p_suspension_id IS NULL THEN
        SELECT r.revision INTO v_revision FROM runs r
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant;
    END IF;

    WITH recorded AS (
        INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)
        SELECT p_message_id, p_routing_key, p_digest, 'applied', p_app, p_tenant, p_run_id
         WHERE p_message_id IS NOT NULL
        ON CONFLICT (app, tenant, message_id) DO NOTHING
        RETURNING 1
    ), claimed AS (
        UPDATE runs r
           SET state = 'running', revision = r.revision + 1, updated_at = now(),
               lease_owner = p_lease_owner,
               lease_expires_at = CASE WHEN p_lease_owner IS NULL THEN NULL
                                       ELSE now() + make_interval(secs => p_lease_ttl) END
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'paused'
           AND r.revision = v_revision
           AND (p_message_id IS NULL OR EXISTS (SELECT 1 FROM recorded))
           AND EXISTS (
               SELECT 1 FROM suspensions s
                WHERE s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
                  AND (p_suspension_id IS NULL OR s.id = p_suspension_id)
                  AND (p_reason IS NULL OR s.reason = p_reason)
                  AND CASE WHEN p_expired_by IS NULL
                           THEN s.expires_at IS NULL OR s.expires_at > now()
                           ELSE s.expires_at IS NOT NULL AND s.expires_at <= LEAST(p_expired_by, now())
                      END)
        RETURNING r.id, r.app, r.tenant, r.revision, r.lease_owner, r.lease_expires_at, r.updated_at,
                  -- The whole row only for a caller that wants it: building it copies the row.
                  CASE WHEN p_rows THEN r END AS whole
    ), answered AS (
        -- At most one pause per run, and the claim holds the run: this is the one it claimed.
        SELECT s.id, s.expires_at, s.continuation, CASE WHEN p_rows THEN s END AS whole
          FROM suspensions s JOIN claimed c ON s.app = c.app AND s.tenant = c.tenant AND s.run_id = c.id
    ), first AS (
        SELECT intermission_write_progress_v1(
                   c.id, c.app, c.tenant, p_lease_owner, COALESCE(p_first_continuation, a.continuation),
                   p_first_started, p_first_done, p_first_ending, p_first_approved) AS updated_at
          FROM claimed c, answered a
         WHERE p_first
    ), dropped AS (
        DELETE FROM suspensions s USING claimed c
         WHERE p_drop_pause AND s.app = c.app AND s.tenant = c.tenant AND s.run_id = c.id
    ), decided AS (
        UPDATE checkpoints k
           SET state = p_checkpoint_state, decided_by = p_decided_by, reason = p_decision_reason,
               decided_at = now()
          FROM claimed c
         WHERE p_checkpoint_id IS NOT NULL AND k.id = p_checkpoint_id
           AND k.app = c.app AND k.tenant = c.tenant AND k.run_id = c.id AND k.state = 'pending'
        RETURNING 1
    ), announced AS (
        INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
        SELECT p_event_message_id, p_event_routing_key, p_event_body, p_event_correlation_id, p_event_headers,
               c.app, c.tenant, c.id
          FROM claimed c
         WHERE p_event_message_id IS NOT NULL
    )
    SELECT c.id AS claimed, c.revision, c.lease_owner, c.lease_expires_at, c.updated_at, a.id AS suspension_id,
           a.expires_at, c.whole AS run, a.whole AS pause, (SELECT f.updated_at FROM first f) AS first_updated_at,
           EXISTS (SELECT 1 FROM recorded) AS recorded, EXISTS (SELECT 1 FROM decided) AS decided
      INTO v_claim
      FROM (SELECT 1) AS one
      LEFT JOIN claimed c ON true
      LEFT JOIN answered a ON true;

    IF v_claim.claimed IS NOT NULL THEN
        IF p_checkpoint_id IS NOT NULL AND NOT v_claim.decided THEN
            RAISE EXCEPTION 'checkpoint % is not pending', p_checkpoint_id
                  USING ERRCODE = 'IM409', HINT = 'invalid_state';
        END IF;
        outcome := 'claimed';
        revision := v_claim.revision;
        lease_owner := v_claim.lease_owner;
        lease_expires_at := v_claim.lease_expires_at;
        updated_at := v_claim.updated_at;
        suspension_id := v_claim.suspension_id;
        expires_at := v_claim.expires_at;
        first_updated_at := v_claim.first_updated_at;
        run := v_claim.run;
        pause := v_claim.pause;
        RETURN;
    END IF;

    IF p_message_id IS NOT NULL THEN
        IF NOT v_claim.recorded THEN
            outcome := intermission_recorded_command_v1(p_app, p_tenant, p_message_id, p_routing_key, p_digest);
            RETURN;
        END IF;
        -- Refused: nothing of this command stays, not even its inbox record.
        DELETE FROM inbox i WHERE i.app = p_app AND i.tenant = p_tenant AND i.message_id = p_message_id;
    END IF;
    SELECT r.* INTO run FROM runs r WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant;
    SELECT s.* INTO pause FROM suspensions s
     WHERE s.run_id = p_run_id AND s.app = p_app AND s.tenant = p_tenant;
    revision := run.revision;
    suspension_id := pause.id;
    expires_at := pause.expires_at;
    outcome := CASE
        WHEN run.id IS NULL OR pause.id IS NULL OR run.state <> 'paused' THEN 'not_suspended'
        WHEN p_suspension_id IS NOT NULL
             AND (pause.id <> p_suspension_id OR run.revision <> p_revision) THEN 'run_conflict'
        WHEN p_reason IS NOT NULL AND pause.reason <> p_reason THEN 'wrong_reason'
        WHEN p_expired_by IS NULL AND pause.expires_at <= now() THEN 'suspension_expired'
        WHEN p_expired_by IS NOT NULL THEN 'not_expired'
        ELSE 'lost'
    END;
END;
$$;

-- A new run (run.start). The caller picks the run id within its scope: the identical start again is
-- 'exists_same' and changes nothing; a different one under that id in the SAME scope is 'run_exists'. A run
-- of that id in another scope is another run, and says nothing here: this start creates its own.
CREATE OR REPLACE FUNCTION intermission_start_run_v1(
    p_run_id text, p_app text, p_tenant text, p_agent_id text, p_input text, p_config jsonb, p_script jsonb,
    p_pause_ttl_seconds integer, p_session_id text, p_start_digest text,
    p_lease_owner text, p_lease_ttl float8,
    p_first_continuation jsonb,
    p_message_id text, p_routing_key text, p_digest text,
    OUT outcome text, OUT run runs, OUT first_updated_at timestamptz
) LANGUAGE plpgsql AS $$
DECLARE
    v_result record;
BEGIN
    WITH recorded AS (
        INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)
        SELECT p_message_id, p_routing_key, p_digest, 'applied', p_app, p_tenant, p_run_id
         WHERE p_message_id IS NOT NULL
        ON CONFLICT (app, tenant, message_id) DO NOTHING
        RETURNING 1
    ), created AS (
        INSERT INTO runs AS r (id, app, tenant, agent_id, input, config, script, pause_ttl_seconds, session_id,
                          start_digest, state, lease_owner, lease_expires_at)
        SELECT p_run_id, p_app, p_tenant, p_agent_id, p_input, p_config, p_script, p_pause_ttl_seconds,
               p_session_id, p_start_digest,
               CASE WHEN p_lease_owner IS NULL THEN 'created'::run_state ELSE 'running'::run_state END,
               p_lease_owner,
               CASE WHEN p_lease_owner IS NULL THEN NULL ELSE now() + make_interval(secs => p_lease_ttl) END
         WHERE p_message_id IS NULL OR EXISTS (SELECT 1 FROM recorded)
        ON CONFLICT (app, tenant, id) DO NOTHING
        RETURNING r AS created_run, r.id, r.app, r.tenant
    ), first AS (
        SELECT intermission_write_progress_v1(c.id, c.app, c.tenant, p_lease_owner, p_first_continuation,
                                              NULL, NULL, NULL, NULL) AS updated_at
          FROM created c
         WHERE p_first_continuation IS NOT NULL
    )
    SELECT c.created_run, (SELECT f.updated_at FROM first f) AS first_updated_at,
           EXISTS (SELECT 1 FROM recorded) AS recorded
      INTO v_result
      FROM (SELECT 1) AS one
      LEFT JOIN created c ON true;

    IF (v_result.created_run).id IS NOT NULL THEN
        run := v_result.created_run;
        first_updated_at := v_result.first_updated_at;
        outcome := 'created';
        RETURN;
    END IF;
    IF p_message_id IS NOT NULL AND NOT v_result.recorded THEN
        outcome := intermission_recorded_command_v1(p_app, p_tenant, p_message_id, p_routing_key, p_digest);
        RETURN;
    END IF;
    SELECT r.* INTO run FROM runs r WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant;
    IF run.start_digest = p_start_digest THEN
        outcome := 'exists_same';
        RETURN;
    END IF;
    outcome := 'run_exists';
    run := NULL;
    IF p_message_id IS NOT NULL THEN
        DELETE FROM inbox i WHERE i.app = p_app AND i.tenant = p_tenant AND i.message_id = p_message_id;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION intermission_pause_run_v1(
    p_run_id text, p_app text, p_tenant text, p_owner text,
    p_reason suspend_reason, p_pending jsonb, p_continuation jsonb, p_approvers text[], p_ttl float8,
    p_step_count integer, p_tokens_used bigint,
    p_notice jsonb, p_event_message_id uuid, p_event_routing_key text, p_event_correlation_id text,
    p_event_headers jsonb,
    OUT revision bigint, OUT pause suspensions, OUT ending jsonb
) LANGUAGE plpgsql AS $$
DECLARE
    v_result record;
BEGIN
    WITH moved AS (
        UPDATE runs r
           SET state = 'paused', revision = r.revision + 1, lease_owner = NULL, lease_expires_at = NULL,
               step_count = p_step_count, tokens_used = p_tokens_used, updated_at = now()
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now()
           AND r.ending IS NULL
        RETURNING r.id, r.app, r.tenant, r.revision, COALESCE(p_ttl, r.pause_ttl_seconds) AS ttl
    ), drawn AS (
        SELECT m.*, nextval('suspension_ids') AS suspension_id FROM moved m
    ), old_pause AS (
        DELETE FROM suspensions s USING drawn d WHERE s.app = d.app AND s.tenant = d.tenant AND s.run_id = d.id
        RETURNING 1
    ), checkpoint AS (
        INSERT INTO checkpoints (run_id, suspension_id, app, tenant, approvers)
        SELECT d.id, d.suspension_id, d.app, d.tenant, p_approvers FROM drawn d WHERE p_reason = 'approval'
        RETURNING id
    ), created AS (
        INSERT INTO suspensions AS s (id, run_id, app, tenant, reason, pending, continuation, expires_at,
                                      checkpoint_id, approvers)
        SELECT d.suspension_id, d.id, d.app, d.tenant, p_reason, p_pending, p_continuation,
               CASE WHEN d.ttl > 0 THEN now() + make_interval(secs => d.ttl) END,
               (SELECT k.id FROM checkpoint k), p_approvers
          -- Reading old_pause makes the old pause go first: at most one pause per run (a unique index).
          FROM drawn d, (SELECT count(*) FROM old_pause) AS gone
        RETURNING s AS created_pause, s.id, s.expires_at, s.checkpoint_id
    ), no_progress AS (
        DELETE FROM progress g USING drawn d WHERE g.app = d.app AND g.tenant = d.tenant AND g.run_id = d.id
    ), noted AS (
        INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
        SELECT gen_random_uuid(), d.id, d.app, d.tenant, 'paused', d.revision,
               jsonb_build_object('suspension_id', d.suspension_id)
          FROM drawn d
    ), announced AS (
        INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
        SELECT p_event_message_id, p_event_routing_key,
               (p_notice || jsonb_build_object('suspension_id', c.id, 'run_revision', d.revision,
                                               'expires_at', c.expires_at, 'checkpoint_id', c.checkpoint_id))::text,
               p_event_correlation_id, p_event_headers, d.app, d.tenant, d.id
          FROM drawn d, created c
    )
    SELECT d.revision, c.created_pause INTO v_result FROM drawn d, created c;
    revision := v_result.revision;
    pause := v_result.created_pause;
    IF revision IS NULL THEN
        SELECT r.ending INTO ending FROM runs r
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now();
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION intermission_pause_run_v2(
    p_run_id text, p_app text, p_tenant text, p_owner text,
    p_reason suspend_reason, p_pending jsonb, p_continuation jsonb, p_approvers text[], p_ttl float8,
    p_step_count integer, p_tokens_used bigint,
    p_notice jsonb, p_event_message_id uuid, p_event_routing_key text, p_event_correlation_id text,
    p_event_headers jsonb, p_outbox_hold float8,
    OUT revision bigint, OUT pause suspensions, OUT ending jsonb, OUT event_body text
) LANGUAGE plpgsql AS $$
DECLARE
    v_result record;
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    WITH moved AS (
        UPDATE runs r
           SET state = 'paused', revision = r.revision + 1, lease_owner = NULL, lease_expires_at = NULL,
               step_count = p_step_count, tokens_used = p_tokens_used, updated_at = now()
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now()
           AND r.ending IS NULL
        RETURNING r.id, r.app, r.tenant, r.revision, COALESCE(p_ttl, r.pause_ttl_seconds) AS ttl
    ), drawn AS (
        SELECT m.*, nextval('suspension_ids') AS suspension_id FROM moved m
    ), old_pause AS (
        DELETE FROM suspensions s USING drawn d WHERE s.app = d.app AND s.tenant = d.tenant AND s.run_id = d.id
        RETURNING 1
    ), checkpoint AS (
        INSERT INTO checkpoints (run_id, suspension_id, app, tenant, approvers)
        SELECT d.id, d.suspension_id, d.app, d.tenant, p_approvers FROM drawn d WHERE p_reason = 'approval'
        RETURNING id
    ), created AS (
        INSERT INTO suspensions AS s (id, run_id, app, tenant, reason, pending, continuation, expires_at,
                                      checkpoint_id, approvers)
        SELECT d.suspension_id, d.id, d.app, d.tenant, p_reason, p_pending, p_continuation,
               CASE WHEN d.ttl > 0 THEN now() + make_interval(secs => d.ttl) END,
               (SELECT k.id FROM checkpoint k), p_approvers
          -- Reading old_pause makes the old pause go first: at most one pause per run (a unique index).
          FROM drawn d, (SELECT count(*) FROM old_pause) AS gone
        RETURNING s AS created_pause, s.id, s.expires_at, s.checkpoint_id
    ), no_progress AS (
        DELETE FROM progress g USING drawn d WHERE g.app = d.app AND g.tenant = d.tenant AND g.run_id = d.id
    ), noted AS (
        INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
        SELECT gen_random_uuid(), d.id, d.app, d.tenant, 'paused', d.revision,
               jsonb_build_object('suspension_id', d.suspension_id)
          FROM drawn d
    ), announced AS (
        INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
        SELECT p_event_message_id, p_event_routing_key,
               (p_notice || jsonb_build_object('suspension_id', c.id, 'run_revision', d.revision,
                                               'expires_at', c.expires_at, 'checkpoint_id', c.checkpoint_id))::text,
               p_event_correlation_id, p_event_headers, d.app, d.tenant, d.id
          FROM drawn d, created c
        RETURNING body
    )
    SELECT d.revision, c.created_pause, (SELECT a.body FROM announced a) AS body
      INTO v_result FROM drawn d, created c;
    revision := v_result.revision;
    pause := v_result.created_pause;
    event_body := v_result.body;
    IF revision IS NULL THEN
        SELECT r.ending INTO ending FROM runs r
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now();
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION intermission_end_run_v1(
    p_run_id text, p_app text, p_tenant text, p_owner text, p_at_revision bigint,
    p_state run_state, p_output text, p_error text, p_messages jsonb, p_checkpoint_reason text,
    p_run_event_id uuid, p_run_event_kind text, p_run_event_data jsonb,
    p_event jsonb, p_event_message_id uuid, p_event_routing_key text, p_event_correlation_id text,
    p_event_headers jsonb, p_step_count integer, p_tokens_used bigint,
    OUT revision bigint, OUT ending jsonb
) LANGUAGE plpgsql AS $$
BEGIN
    WITH ended AS (
        UPDATE runs r
           SET state = p_state, revision = r.revision + 1, lease_owner = NULL, lease_expires_at = NULL,
               output = p_output, error = p_error, updated_at = now(), ended_at = now(), ending = NULL,
               step_count = COALESCE(p_step_count, r.step_count),
               tokens_used = COALESCE(p_tokens_used, r.tokens_used)
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND CASE WHEN p_owner IS NULL
                    THEN p_at_revision IS NOT NULL AND r.revision = p_at_revision
                    ELSE p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now()
                         AND (r.ending IS NULL OR p_state = 'cancelled')
               END
        RETURNING r.id, r.app, r.tenant, r.revision, r.session_id
    ), saved AS (
        INSERT INTO session_messages (app, tenant, session_id, run_id, message)
        SELECT e.app, e.tenant, e.session_id, e.id, t.m
          FROM ended e, jsonb_array_elements(p_messages) WITH ORDINALITY AS t (m, n)
         WHERE p_messages IS NOT NULL
         ORDER BY t.n
    ), no_progress AS (
        DELETE FROM progress g USING ended e WHERE g.app = e.app AND g.tenant = e.tenant AND g.run_id = e.id
    ), no_pause AS (
        DELETE FROM suspensions s USING ended e WHERE s.app = e.app AND s.tenant = e.tenant AND s.run_id = e.id
    ), closed AS (
        UPDATE checkpoints k SET state = 'rejected', reason = p_checkpoint_reason, decided_at = now()
          FROM ended e
         WHERE k.app = e.app AND k.tenant = e.tenant AND k.run_id = e.id AND k.state = 'pending'
    ), noted AS (
        INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
        SELECT p_run_event_id, e.id, e.app, e.tenant, p_run_event_kind, e.revision, p_run_event_data FROM ended e
    ), announced AS (
        INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
        SELECT p_event_message_id, p_event_routing_key, (p_event || jsonb_build_object('revision', e.revision))::text,
               p_event_correlation_id, p_event_headers, e.app, e.tenant, e.id
          FROM ended e
    )
    SELECT e.revision INTO revision FROM ended e;
    IF revision IS NULL AND p_owner IS NOT NULL THEN
        SELECT r.ending INTO ending FROM runs r
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now();
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION intermission_end_run_v2(
    p_run_id text, p_app text, p_tenant text, p_owner text, p_at_revision bigint,
    p_state run_state, p_output text, p_error text, p_messages jsonb, p_checkpoint_reason text,
    p_run_event_id uuid, p_run_event_kind text, p_run_event_data jsonb,
    p_event jsonb, p_event_message_id uuid, p_event_routing_key text, p_event_correlation_id text,
    p_event_headers jsonb, p_step_count integer, p_tokens_used bigint, p_outbox_hold float8,
    OUT revision bigint, OUT ending jsonb, OUT event_body text
) LANGUAGE plpgsql AS $$
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    WITH ended AS (
        UPDATE runs r
           SET state = p_state, revision = r.revision + 1, lease_owner = NULL, lease_expires_at = NULL,
               output = p_output, error = p_error, updated_at = now(), ended_at = now(), ending = NULL,
               step_count = COALESCE(p_step_count, r.step_count),
               tokens_used = COALESCE(p_tokens_used, r.tokens_used)
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND CASE WHEN p_owner IS NULL
                    THEN p_at_revision IS NOT NULL AND r.revision = p_at_revision
                    ELSE p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now()
                         AND (r.ending IS NULL OR p_state = 'cancelled')
               END
        RETURNING r.id, r.app, r.tenant, r.revision, r.session_id
    ), saved AS (
        INSERT INTO session_messages (app, tenant, session_id, run_id, message)
        SELECT e.app, e.tenant, e.session_id, e.id, t.m
          FROM ended e, jsonb_array_elements(p_messages) WITH ORDINALITY AS t (m, n)
         WHERE p_messages IS NOT NULL
         ORDER BY t.n
    ), no_progress AS (
        DELETE FROM progress g USING ended e WHERE g.app = e.app AND g.tenant = e.tenant AND g.run_id = e.id
    ), no_pause AS (
        DELETE FROM suspensions s USING ended e WHERE s.app = e.app AND s.tenant = e.tenant AND s.run_id = e.id
    ), closed AS (
        UPDATE checkpoints k SET state = 'rejected', reason = p_checkpoint_reason, decided_at = now()
          FROM ended e
         WHERE k.app = e.app AND k.tenant = e.tenant AND k.run_id = e.id AND k.state = 'pending'
    ), noted AS (
        INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
        SELECT p_run_event_id, e.id, e.app, e.tenant, p_run_event_kind, e.revision, p_run_event_data FROM ended e
    ), announced AS (
        INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
        SELECT p_event_message_id, p_event_routing_key, (p_event || jsonb_build_object('revision', e.revision))::text,
               p_event_correlation_id, p_event_headers, e.app, e.tenant, e.id
          FROM ended e
        RETURNING body
    )
    SELECT e.revision, (SELECT a.body FROM announced a) INTO revision, event_body FROM ended e;
    IF revision IS NULL AND p_owner IS NOT NULL THEN
        SELECT r.ending INTO ending FROM runs r
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now();
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION intermission_request_ending_v1(
    p_run_id text, p_app text, p_tenant text, p_ending jsonb,
    p_message_id text, p_routing_key text, p_digest text,
    OUT outcome text, OUT revision bigint, OUT lease_owner text
) LANGUAGE plpgsql AS $$
DECLARE
    v_result record;
    v_run runs;
BEGIN
    WITH recorded AS (
        INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)
        SELECT p_message_id, p_routing_key, p_digest, 'applied', p_app, p_tenant, p_run_id
         WHERE p_message_id IS NOT NULL
        ON CONFLICT (app, tenant, message_id) DO NOTHING
        RETURNING 1
    ), asked AS (
        UPDATE runs r
           SET ending = p_ending
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND r.lease_owner IS NOT NULL AND r.ending IS NULL
           AND NOT EXISTS (SELECT 1 FROM progress g
                            WHERE g.app = r.app AND g.tenant = r.tenant AND g.run_id = r.id
                              AND g.ending IS NOT NULL)
           AND (p_message_id IS NULL OR EXISTS (SELECT 1 FROM recorded))
        RETURNING r.id, r.app, r.tenant, r.revision, r.lease_owner
    ), noted AS (
        UPDATE progress g SET ending = p_ending FROM asked a
         WHERE g.app = a.app AND g.tenant = a.tenant AND g.run_id = a.id AND g.ending IS NULL
    )
    SELECT a.id, a.revision, a.lease_owner, EXISTS (SELECT 1 FROM recorded) AS recorded
      INTO v_result
      FROM (SELECT 1) AS one
      LEFT JOIN asked a ON true;

    IF v_result.id IS NOT NULL THEN
        outcome := 'requested';
        revision := v_result.revision;
        lease_owner := v_result.lease_owner;
        RETURN;
    END IF;
    IF p_message_id IS NOT NULL AND NOT v_result.recorded THEN
        outcome := intermission_recorded_command_v1(p_app, p_tenant, p_message_id, p_routing_key, p_digest);
        RETURN;
    END IF;
    SELECT r.* INTO v_run FROM runs r WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant;
    revision := v_run.revision;
    lease_owner := v_run.lease_owner;
    outcome := CASE
        WHEN v_run.id IS NULL OR v_run.state <> 'running' THEN 'not_running'
        WHEN v_run.lease_owner IS NULL THEN 'not_leased'
        ELSE 'ending_before'
    END;
    IF outcome <> 'ending_before' AND p_message_id IS NOT NULL THEN
        -- Refused: nothing of this command stays, not even its inbox record.
        DELETE FROM inbox i WHERE i.app = p_app AND i.tenant = p_tenant AND i.message_id = p_message_id;
    END IF;
END;
$$;

-- The takeover keeps the runs it took by their whole key, and reads each one back (its snapshot handed over,
-- or replaced by p_first_continuation for the one run named) by that key: one probe of each key, whatever
-- the planner thinks of the batch's size (migration 0013 says why an array of keys is not one statement).
CREATE OR REPLACE FUNCTION intermission_take_over_v1(
    p_owner text, p_lease_ttl float8, p_limit integer,
    p_run_id text, p_app text, p_tenant text,
    p_first_continuation jsonb, p_first_started jsonb, p_first_done jsonb, p_first_ending jsonb,
    p_first_approved jsonb
) RETURNS TABLE (taken_run runs, taken_progress progress) LANGUAGE plpgsql AS $$
DECLARE
    v_apps text[];
    v_tenants text[];
    v_ids text[];
BEGIN
    IF p_run_id IS NOT NULL THEN
        UPDATE runs r
           SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_ttl),
               updated_at = now()
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND r.lease_expires_at <= now()
        RETURNING ARRAY[r.app], ARRAY[r.tenant], ARRAY[r.id] INTO v_apps, v_tenants, v_ids;
    ELSE
        WITH lapsed AS (
            SELECT r.app, r.tenant, r.id FROM runs r
             WHERE r.state = 'running' AND r.lease_expires_at <= now()
             ORDER BY r.lease_expires_at
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED
        ), moved AS (
            UPDATE runs r
               SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_ttl),
                   updated_at = now()
              FROM lapsed l
             WHERE r.app = l.app AND r.tenant = l.tenant AND r.id = l.id
            RETURNING r.app, r.tenant, r.id
        )
        SELECT array_agg(m.app), array_agg(m.tenant), array_agg(m.id) INTO v_apps, v_tenants, v_ids FROM moved m;
    END IF;
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    IF p_first_continuation IS NOT NULL THEN
        PERFORM intermission_write_progress_v1(p_run_id, p_app, p_tenant, p_owner, p_first_continuation,
                                               p_first_started, p_first_done, p_first_ending, p_first_approved);
    END IF;
    FOR i IN 1 .. cardinality(v_ids) LOOP
        IF p_first_continuation IS NULL THEN
            -- The snapshot belongs to whoever holds the run: it goes over with the lease.
            UPDATE progress g SET owner = p_owner, updated_at = now()
             WHERE g.app = v_apps[i] AND g.tenant = v_tenants[i] AND g.run_id = v_ids[i];
        END IF;
        RETURN QUERY
        SELECT r, g FROM runs r
          LEFT JOIN progress g ON g.app = r.app AND g.tenant = r.tenant AND g.run_id = r.id
         WHERE r.app = v_apps[i] AND r.tenant = v_tenants[i] AND r.id = v_ids[i];
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION intermission_start_resume_v1(
    p_run_id text, p_app text, p_tenant text, p_suspension_id bigint, p_digest text,
    p_lease_owner text, p_lease_ttl float8,
    p_first_continuation jsonb, p_first_done jsonb, p_schema_version integer,
    OUT outcome text, OUT start resume_starts, OUT expired_at timestamptz, OUT run runs, OUT pause suspensions
) LANGUAGE plpgsql AS $$
DECLARE
    v_admission resume_admissions;
BEGIN
    SELECT r.* INTO run FROM runs r WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant
       FOR UPDATE;
    SELECT a.* INTO v_admission FROM resume_admissions a
     WHERE a.run_id = p_run_id AND a.suspension_id = p_suspension_id AND a.app = p_app AND a.tenant = p_tenant;
    SELECT st.* INTO start FROM resume_starts st
     WHERE st.run_id = p_run_id AND st.suspension_id = p_suspension_id AND st.app = p_app
       AND st.tenant = p_tenant;
    SELECT ex.expired_at INTO expired_at FROM resume_expiries ex
     WHERE ex.run_id = p_run_id AND ex.suspension_id = p_suspension_id AND ex.app = p_app
       AND ex.tenant = p_tenant;
    SELECT s.* INTO pause FROM suspensions s
     WHERE s.id = p_suspension_id AND s.run_id = p_run_id AND s.app = p_app AND s.tenant = p_tenant;
    outcome := CASE
        WHEN v_admission.run_id IS NULL THEN 'no_admission'
        WHEN v_admission.request_digest <> p_digest THEN 'digest_conflict'
        WHEN start.run_id IS NOT NULL THEN 'started_before'
        WHEN expired_at IS NOT NULL THEN 'expired'
        WHEN run.id IS NULL OR run.state <> 'running' OR run.revision <> v_admission.claimed_revision
            THEN 'run_conflict'
        WHEN pause.id IS NULL THEN 'pause_gone'
        ELSE 'started'
    END;
    IF outcome <> 'started' THEN
        IF outcome <> 'started_before' THEN
            start := NULL;
        END IF;
        pause := NULL;
        RETURN;
    END IF;
    IF p_lease_owner IS NOT NULL THEN
        UPDATE runs r
           SET lease_owner = p_lease_owner, lease_expires_at = now() + make_interval(secs => p_lease_ttl),
               updated_at = now()
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant
        RETURNING r.* INTO run;
        IF p_first_continuation IS NOT NULL THEN
            PERFORM intermission_write_progress_v1(p_run_id, p_app, p_tenant, p_lease_owner,
                                                   p_first_continuation, NULL, p_first_done, NULL, NULL);
        END IF;
    END IF;
    INSERT INTO resume_starts (run_id, suspension_id, app, tenant, schema_version, pinned_revision,
                               request_digest)
    VALUES (p_run_id, p_suspension_id, p_app, p_tenant, p_schema_version, v_admission.pinned_revision,
            v_admission.request_digest)
    RETURNING * INTO start;
END;
$$;

-- One batch of ended runs past retention with everything about them, each run by its whole key. Rows that
-- reference others go first (closures, then expiries and starts, then the admissions they name), as before.
CREATE OR REPLACE FUNCTION intermission_prune_runs_v1(p_ended_before timestamptz, p_limit int)
RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_apps text[];
    v_tenants text[];
    v_ids text[];
    v_counts jsonb := '{}';
    v_n bigint;
BEGIN
    SELECT coalesce(array_agg(r.app), '{}'), coalesce(array_agg(r.tenant), '{}'), coalesce(array_agg(r.id), '{}')
      INTO v_apps, v_tenants, v_ids
      FROM (SELECT r.app, r.tenant, r.id FROM runs r
             WHERE r.ended_at IS NOT NULL AND r.ended_at < p_ended_before
               AND r.state IN ('completed', 'failed', 'cancelled')
             ORDER BY r.ended_at
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED) r;
    IF cardinality(v_ids) = 0 THEN
        RETURN v_counts;
    END IF;
    DELETE FROM suspensions x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('suspensions', v_n);
    DELETE FROM checkpoints x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('checkpoints', v_n);
    DELETE FROM progress x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('progress', v_n);
    DELETE FROM resume_closures x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_closures', v_n);
    DELETE FROM resume_expiries x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_expiries', v_n);
    DELETE FROM resume_starts x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_starts', v_n);
    DELETE FROM resume_admissions x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_admissions', v_n);
    DELETE FROM run_events x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('run_events', v_n);
    DELETE FROM demo_charges x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.run_id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('demo_charges', v_n);
    DELETE FROM runs x USING unnest(v_apps, v_tenants, v_ids) AS d (app, tenant, id)
     WHERE x.app = d.app AND x.tenant = d.tenant AND x.id = d.id;
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('runs', v_n);
    RETURN v_counts;
END;
$$;
