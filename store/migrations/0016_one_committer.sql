-- One committer (engine/committer.py): every transition is applied in batches, each batch function taking
-- ONE array of a composite type, the transition's input row named once, instead of one array per argument.
--
-- A worker groups the transitions that wait at the same moment (claims, starts, step saves, pauses, ends,
-- cancels, reply admissions and starts, expiries, closures, deadline moves, outbox retries) into one
-- statement per kind: one round trip and one commit for all of them, each transition still whole and its
-- outcome its own. Each batch function applies its rows in array order (the caller sorts them by run, so
-- that two batches take the rows they share in the same order), each row seeing what the rows before it
-- wrote, and returns one row per input row with its position n (from 1).
--
-- What changes besides the batch shape:
--   * a pause's Notice and an end's run.* event are given whole: the body is built by the worker's one
--     encoder (engine/events.py) and stored as it is given, never re-encoded here. A pause's id and its
--     checkpoint's are drawn by the worker before the statement (draw_pause_keys), its deadline computed
--     from the database clock read with them, and the run's revision it pauses or ends is the one the
--     caller holds, checked here (intermission_pause_run_v3, intermission_end_run_v3);
--   * an admission's expiry and a closure, two statements under a row lock in the worker until now, are
--     functions like the other transitions (intermission_expire_admission_v1, intermission_close_resume_v1).
--
-- Nothing released is edited: the previous release's workers keep calling their functions (the _v1 and
-- _v2 transitions and the statements built of parallel arrays) during a rolling deploy, and the functions
-- whose logic is unchanged are what the new batch functions call for each row. Migration 0017, once no
-- worker of the previous release runs, drops what only that release calls: intermission_pause_run_v1 and
-- _v2, intermission_end_run_v1 and _v2 (docs/store.md, "Rolling deploys").

CREATE TYPE intermission_command_key_v1 AS (
    run_id text, app text, tenant text, message_id text, checkpoint_id bigint
);

-- What a read for a pause's evidence names: a run's pause by its id.
CREATE TYPE intermission_pause_key_v1 AS (run_id text, app text, tenant text, suspension_id bigint);

-- What a run's history is read by: its session, and the most messages it loads.
CREATE TYPE intermission_session_key_v1 AS (app text, tenant text, session_id text, most integer);

-- What a pause draws before its statement: its id, and for an approval its checkpoint's.
CREATE TYPE intermission_pause_draw_v1 AS (approval boolean);

CREATE TYPE intermission_claim_v2 AS (
    run_id text, app text, tenant text,
    suspension_id bigint, revision bigint, expired_by timestamptz, reason suspend_reason,
    lease_owner text, lease_ttl float8,
    first boolean, first_continuation jsonb, first_started jsonb, first_done jsonb, first_ending jsonb,
    first_approved jsonb,
    drop_pause boolean,
    message_id text, routing_key text, digest text,
    checkpoint_id bigint, checkpoint_state text, decided_by text, decision_reason text,
    event_message_id uuid, event_routing_key text, event_body text, event_correlation_id text,
    event_headers jsonb,
    whole boolean
);

CREATE TYPE intermission_start_v2 AS (
    run_id text, app text, tenant text, agent_id text, input text, config jsonb, script jsonb,
    pause_ttl_seconds integer, session_id text, start_digest text, lease_owner text, lease_ttl float8,
    first_continuation jsonb, message_id text, routing_key text, digest text,
    default_live_runs integer, default_starts_per_second float8
);

CREATE TYPE intermission_save_v2 AS (
    run_id text, app text, tenant text, owner text,
    continuation jsonb, started jsonb, done jsonb, ending jsonb, approved jsonb,
    step_count integer, tokens_used bigint
);

CREATE TYPE intermission_pause_v3 AS (
    run_id text, app text, tenant text, owner text, revision bigint,
    suspension_id bigint, checkpoint_id bigint,
    reason suspend_reason, pending jsonb, continuation jsonb, approvers text[], expires_at timestamptz,
    step_count integer, tokens_used bigint,
    event_message_id uuid, event_routing_key text, event_body text, event_correlation_id text,
    event_headers jsonb
);

CREATE TYPE intermission_end_v3 AS (
    run_id text, app text, tenant text, owner text, revision bigint,
    state run_state, output text, error text, messages jsonb, checkpoint_reason text,
    run_event_id uuid, run_event_kind text, run_event_data jsonb,
    step_count integer, tokens_used bigint,
    event_message_id uuid, event_routing_key text, event_body text, event_correlation_id text,
    event_headers jsonb
);

CREATE TYPE intermission_ending_v2 AS (
    run_id text, app text, tenant text, ending jsonb, message_id text, routing_key text, digest text
);

CREATE TYPE intermission_admission_v2 AS (
    run_id text, app text, tenant text, suspension_id bigint, revision bigint,
    lease_owner text, lease_ttl float8, first_continuation jsonb, first_done jsonb,
    schema_version integer, input bytea, request_digest text, suspension_digest text,
    message_id text, routing_key text, digest text,
    event_message_id uuid, event_routing_key text, event_body text, event_correlation_id text,
    event_headers jsonb
);

CREATE TYPE intermission_resume_start_v2 AS (
    run_id text, app text, tenant text, suspension_id bigint, digest text,
    lease_owner text, lease_ttl float8, first_continuation jsonb, first_done jsonb, schema_version integer
);

CREATE TYPE intermission_admission_expiry_v1 AS (
    run_id text, app text, tenant text, suspension_id bigint, digest text, schema_version integer,
    event_id uuid
);

CREATE TYPE intermission_closure_v1 AS (
    run_id text, app text, tenant text, suspension_id bigint,
    schema_version integer, request jsonb, request_digest text,
    -- What the request binds: the latest admission (its pinned revision and digest), the start the worker
    -- read and checked against the request's start digest (started_at names the row it read; a start row
    -- never changes), the run's revision, and the proof's deadline.
    pinned_revision bigint, admission_digest text, start_started_at timestamptz, start_matches boolean,
    run_revision bigint, proof_expires_at timestamptz,
    -- The end it writes (intermission_end_v3's fields, the run's owner left out: a closure holds no lease).
    error text, run_event_id uuid, run_event_data jsonb,
    event_message_id uuid, event_routing_key text, event_body text, event_correlation_id text,
    event_headers jsonb
);

CREATE TYPE intermission_deadline_v2 AS (
    run_id text, app text, tenant text, suspension_id bigint, extend_by float8, moved_by text
);

CREATE TYPE intermission_take_over_v2 AS (
    owner text, lease_ttl float8, lapsed_limit integer, run_id text, app text, tenant text,
    first_continuation jsonb, first_started jsonb, first_done jsonb, first_ending jsonb, first_approved jsonb
);

CREATE TYPE intermission_create_pause_v2 AS (
    run_id text, app text, tenant text, reason suspend_reason, pending jsonb, continuation jsonb,
    expires_at timestamptz, ttl float8, checkpoint_id bigint, approvers text[]
);

CREATE TYPE intermission_run_key_v1 AS (run_id text, app text, tenant text, owner text);

CREATE TYPE intermission_outbox_retry_v1 AS (id bigint);

-- === the transitions whose logic is new ============================================================

-- A pause, its Notice given whole: the run moves to paused (revision + 1) only while p.owner holds its live
-- lease at p.revision and nobody asked it to end; the old pause goes, the new one (and for an approval its
-- checkpoint) is written under the ids the worker drew, with the deadline it computed from the database
-- clock; the snapshot goes; the Notice goes to the outbox exactly as given. Otherwise nothing is written and
-- the outcome says why: 'ending_requested' (with the ending: the holder must finish that instead),
-- 'revision_moved' (held, at another revision than the caller's: a bug upstream) or 'not_held'.
CREATE FUNCTION intermission_pause_run_v3(
    p intermission_pause_v3, OUT outcome text, OUT revision bigint, OUT pause suspensions, OUT ending jsonb
) LANGUAGE plpgsql AS $$
DECLARE
    v_run runs;
BEGIN
    UPDATE runs r
       SET state = 'paused', revision = r.revision + 1, lease_owner = NULL, lease_expires_at = NULL,
           step_count = p.step_count, tokens_used = p.tokens_used, updated_at = now()
     WHERE r.id = p.run_id AND r.app = p.app AND r.tenant = p.tenant AND r.state = 'running'
       AND p.owner <> '' AND r.lease_owner = p.owner AND r.lease_expires_at > now()
       AND r.ending IS NULL AND r.revision = p.revision
    RETURNING r.revision INTO revision;
    IF revision IS NULL THEN
        SELECT r.* INTO v_run FROM runs r
         WHERE r.id = p.run_id AND r.app = p.app AND r.tenant = p.tenant AND r.state = 'running'
           AND p.owner <> '' AND r.lease_owner = p.owner AND r.lease_expires_at > now();
        IF v_run.id IS NULL THEN
            outcome := 'not_held';
        ELSIF v_run.ending IS NOT NULL THEN
            outcome := 'ending_requested';
            ending := v_run.ending;
        ELSE
            outcome := 'revision_moved';
            revision := v_run.revision;
        END IF;
        RETURN;
    END IF;
    -- At most one pause per run (a unique index): the old one goes first.
    DELETE FROM suspensions s WHERE s.app = p.app AND s.tenant = p.tenant AND s.run_id = p.run_id;
    IF p.reason = 'approval' THEN
        -- The id the worker drew from the checkpoints' own identity sequence (draw_pause_keys).
        INSERT INTO checkpoints (id, run_id, suspension_id, app, tenant, approvers) OVERRIDING SYSTEM VALUE
        VALUES (p.checkpoint_id, p.run_id, p.suspension_id, p.app, p.tenant, p.approvers);
    END IF;
    INSERT INTO suspensions AS s (id, run_id, app, tenant, reason, pending, continuation, expires_at,
                                  checkpoint_id, approvers)
    VALUES (p.suspension_id, p.run_id, p.app, p.tenant, p.reason, p.pending, p.continuation, p.expires_at,
            CASE WHEN p.reason = 'approval' THEN p.checkpoint_id END, p.approvers)
    RETURNING s.* INTO pause;
    DELETE FROM progress g WHERE g.app = p.app AND g.tenant = p.tenant AND g.run_id = p.run_id;
    INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
    VALUES (gen_random_uuid(), p.run_id, p.app, p.tenant, 'paused', revision,
            jsonb_build_object('suspension_id', p.suspension_id));
    INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
    VALUES (p.event_message_id, p.event_routing_key, p.event_body, p.event_correlation_id, p.event_headers,
            p.app, p.tenant, p.run_id);
    outcome := 'paused';
END;
$$;

-- An end, its run.* event given whole. With an owner: only while that owner holds the run's live lease at
-- p.revision, and, when the run was asked to end while it ran, only as cancelled. Without one (a closure,
-- which holds the run's row lock and checked it): only at p.revision. The run takes the terminal state
-- (revision + 1), its own messages go into its session, its snapshot and pause go, its undecided
-- checkpoints close, the metadata event and the run.* event are written. Otherwise nothing is written:
-- 'ending_requested' (with the ending), 'revision_moved', 'not_held' (an owner's end), 'not_at_revision'.
CREATE FUNCTION intermission_end_run_v3(
    p intermission_end_v3, OUT outcome text, OUT revision bigint, OUT ending jsonb
) LANGUAGE plpgsql AS $$
DECLARE
    v_session text;
    v_run runs;
BEGIN
    UPDATE runs r
       SET state = p.state, revision = r.revision + 1, lease_owner = NULL, lease_expires_at = NULL,
           output = p.output, error = p.error, updated_at = now(), ended_at = now(), ending = NULL,
           step_count = COALESCE(p.step_count, r.step_count), tokens_used = COALESCE(p.tokens_used, r.tokens_used)
     WHERE r.id = p.run_id AND r.app = p.app AND r.tenant = p.tenant AND r.state = 'running'
       AND r.revision = p.revision
       AND (p.owner IS NULL
            OR (p.owner <> '' AND r.lease_owner = p.owner AND r.lease_expires_at > now()
                AND (r.ending IS NULL OR p.state = 'cancelled')))
    RETURNING r.revision, r.session_id INTO revision, v_session;
    IF revision IS NULL THEN
        IF p.owner IS NULL THEN
            outcome := 'not_at_revision';
            RETURN;
        END IF;
        SELECT r.* INTO v_run FROM runs r
         WHERE r.id = p.run_id AND r.app = p.app AND r.tenant = p.tenant AND r.state = 'running'
           AND p.owner <> '' AND r.lease_owner = p.owner AND r.lease_expires_at > now();
        IF v_run.id IS NULL THEN
            outcome := 'not_held';
        ELSIF v_run.ending IS NOT NULL AND p.state <> 'cancelled' THEN
            outcome := 'ending_requested';
            ending := v_run.ending;
        ELSE
            outcome := 'revision_moved';
            revision := v_run.revision;
        END IF;
        RETURN;
    END IF;
    IF p.messages IS NOT NULL THEN
        INSERT INTO session_messages (app, tenant, session_id, run_id, message)
        SELECT p.app, p.tenant, v_session, p.run_id, t.m
          FROM jsonb_array_elements(p.messages) WITH ORDINALITY AS t (m, n)
         ORDER BY t.n;
    END IF;
    DELETE FROM progress g WHERE g.app = p.app AND g.tenant = p.tenant AND g.run_id = p.run_id;
    DELETE FROM suspensions s WHERE s.app = p.app AND s.tenant = p.tenant AND s.run_id = p.run_id;
    UPDATE checkpoints k SET state = 'rejected', reason = p.checkpoint_reason, decided_at = now()
     WHERE k.app = p.app AND k.tenant = p.tenant AND k.run_id = p.run_id AND k.state = 'pending';
    INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
    VALUES (p.run_event_id, p.run_id, p.app, p.tenant, p.run_event_kind, revision, p.run_event_data);
    INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
    VALUES (p.event_message_id, p.event_routing_key, p.event_body, p.event_correlation_id, p.event_headers,
            p.app, p.tenant, p.run_id);
    outcome := 'ended';
END;
$$;

-- An agent reply's admission expired before it started: the expiry and its run_events row, under the run's
-- row lock that a start takes too, so the two cannot both commit for one admission. 'expired', or the
-- identical expiry recorded before ('expired_before', with it); 'no_admission', 'digest_conflict' (the
-- admission has another request digest), 'started' (it may have executed: only a closure ends that),
-- 'no_run'. It does not change the run.
CREATE FUNCTION intermission_expire_admission_v1(
    p intermission_admission_expiry_v1, OUT outcome text, OUT expiry resume_expiries
) LANGUAGE plpgsql AS $$
DECLARE
    v_run runs;
    v_admission resume_admissions;
BEGIN
    SELECT r.* INTO v_run FROM runs r WHERE r.id = p.run_id AND r.app = p.app AND r.tenant = p.tenant
       FOR UPDATE;
    SELECT a.* INTO v_admission FROM resume_admissions a
     WHERE a.run_id = p.run_id AND a.suspension_id = p.suspension_id AND a.app = p.app AND a.tenant = p.tenant;
    IF v_admission.run_id IS NULL THEN
        outcome := 'no_admission';
        RETURN;
    END IF;
    IF v_admission.request_digest <> p.digest THEN
        outcome := 'digest_conflict';
        RETURN;
    END IF;
    SELECT x.* INTO expiry FROM resume_expiries x
     WHERE x.run_id = p.run_id AND x.suspension_id = p.suspension_id AND x.app = p.app AND x.tenant = p.tenant;
    IF expiry.run_id IS NOT NULL THEN
        outcome := 'expired_before';
        RETURN;
    END IF;
    expiry := NULL;
    IF EXISTS (SELECT 1 FROM resume_starts st
                WHERE st.run_id = p.run_id AND st.suspension_id = p.suspension_id AND st.app = p.app
                  AND st.tenant = p.tenant) THEN
        outcome := 'started';
        RETURN;
    END IF;
    IF v_run.id IS NULL THEN
        outcome := 'no_run';
        RETURN;
    END IF;
    INSERT INTO resume_expiries (run_id, suspension_id, app, tenant, schema_version, pinned_revision,
                                 request_digest, event_id, run_revision)
    VALUES (p.run_id, p.suspension_id, p.app, p.tenant, p.schema_version, v_admission.pinned_revision,
            v_admission.request_digest, p.event_id, v_run.revision)
    RETURNING * INTO expiry;
    INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
    VALUES (p.event_id, p.run_id, p.app, p.tenant, 'resume_expired', v_run.revision,
            jsonb_build_object('suspension_id', p.suspension_id, 'request_digest', v_admission.request_digest));
    outcome := 'expired';
END;
$$;

-- A closure of an uncertain start, as incomplete, under the run's row lock (serialised with every run
-- writer): the identical closure recorded before comes back ('closed_before', with it; another request for
-- that pause is 'closure_conflict'), whatever happened since. Otherwise the request must still bind the world
-- under the lock, checked in this order: the run exists ('no_run'), the proof has not expired by the
-- database clock ('proof_expired'), the run's LATEST admission is the one bound ('no_admission',
-- 'not_latest', 'admission_conflict'), its start is the row the worker read and checked ('no_start',
-- 'start_moved', 'start_conflict'), the run is at the bound revision ('stale') and running ('not_running').
-- Then the run ends failed through intermission_end_run_v3 and the receipt is written: 'closed'.
CREATE FUNCTION intermission_close_resume_v1(
    p intermission_closure_v1, OUT outcome text, OUT closure resume_closures, OUT revision bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_run runs;
    v_latest resume_admissions;
    v_start resume_starts;
    v_ended record;
BEGIN
    SELECT r.* INTO v_run FROM runs r WHERE r.id = p.run_id AND r.app = p.app AND r.tenant = p.tenant
       FOR UPDATE;
    SELECT c.* INTO closure FROM resume_closures c
     WHERE c.run_id = p.run_id AND c.suspension_id = p.suspension_id AND c.app = p.app AND c.tenant = p.tenant;
    IF closure.run_id IS NOT NULL THEN
        outcome := CASE WHEN closure.request_digest = p.request_digest THEN 'closed_before'
                        ELSE 'closure_conflict' END;
        RETURN;
    END IF;
    closure := NULL;
    IF v_run.id IS NULL THEN
        outcome := 'no_run';
        RETURN;
    END IF;
    IF p.proof_expires_at <= now() THEN
        outcome := 'proof_expired';
        RETURN;
    END IF;
    SELECT a.* INTO v_latest FROM resume_admissions a
     WHERE a.run_id = p.run_id AND a.app = p.app AND a.tenant = p.tenant
     ORDER BY a.suspension_id DESC LIMIT 1;
    IF v_latest.run_id IS NULL THEN
        outcome := 'no_admission';
        RETURN;
    END IF;
    IF v_latest.suspension_id <> p.suspension_id THEN
        outcome := 'not_latest';
        revision := v_latest.suspension_id;
        RETURN;
    END IF;
    IF v_latest.pinned_revision <> p.pinned_revision OR v_latest.request_digest <> p.admission_digest THEN
        outcome := 'admission_conflict';
        RETURN;
    END IF;
    SELECT st.* INTO v_start FROM resume_starts st
     WHERE st.run_id = p.run_id AND st.suspension_id = p.suspension_id AND st.app = p.app AND st.tenant = p.tenant;
    IF v_start.run_id IS NULL THEN
        outcome := 'no_start';
        RETURN;
    END IF;
    IF v_start.started_at IS DISTINCT FROM p.start_started_at THEN
        outcome := 'start_moved';
        RETURN;
    END IF;
    IF NOT p.start_matches THEN
        outcome := 'start_conflict';
        RETURN;
    END IF;
    IF v_run.revision <> p.run_revision THEN
        outcome := 'stale';
        revision := v_run.revision;
        RETURN;
    END IF;
    IF v_run.state <> 'running' THEN
        outcome := 'not_running';
        RETURN;
    END IF;
    SELECT * INTO v_ended FROM intermission_end_run_v3(ROW(
        p.run_id, p.app, p.tenant, NULL, p.run_revision, 'failed', NULL, p.error, NULL, p.error,
        p.run_event_id, 'resume_closed', p.run_event_data, NULL, NULL,
        p.event_message_id, p.event_routing_key, p.event_body, p.event_correlation_id, p.event_headers
    )::intermission_end_v3);
    IF v_ended.outcome <> 'ended' THEN
        RAISE EXCEPTION 'run % could not be closed: %', p.run_id, v_ended.outcome
              USING ERRCODE = 'IM409', HINT = 'invalid_state';
    END IF;
    revision := v_ended.revision;
    INSERT INTO resume_closures (run_id, suspension_id, app, tenant, schema_version, request, request_digest,
                                 event_id, run_revision)
    VALUES (p.run_id, p.suspension_id, p.app, p.tenant, p.schema_version, p.request, p.request_digest,
            p.run_event_id, revision)
    RETURNING * INTO closure;
    outcome := 'closed';
END;
$$;

-- === the batch functions: one array of the transition's row, applied in order ========================

CREATE FUNCTION intermission_claim_pauses_v2(p_rows intermission_claim_v2[], p_outbox_hold float8)
RETURNS TABLE (n integer, outcome text, revision bigint, lease_owner text, lease_expires_at timestamptz,
               updated_at timestamptz, suspension_id bigint, expires_at timestamptz,
               first_updated_at timestamptz, run runs, pause suspensions)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_claim_v2;
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_claim_pause_v1(
              c.run_id, c.app, c.tenant, c.suspension_id, c.revision, c.expired_by, c.reason, c.lease_owner,
              c.lease_ttl, c.first, c.first_continuation, c.first_started, c.first_done, c.first_ending,
              c.first_approved, c.drop_pause, c.message_id, c.routing_key, c.digest, c.checkpoint_id,
              c.checkpoint_state, c.decided_by, c.decision_reason, c.event_message_id, c.event_routing_key,
              c.event_body, c.event_correlation_id, c.event_headers, c.whole) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_start_runs_v2(p_rows intermission_start_v2[])
RETURNS TABLE (n integer, outcome text, run runs, first_updated_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_start_v2;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_start_run_v2(
              c.run_id, c.app, c.tenant, c.agent_id, c.input, c.config, c.script, c.pause_ttl_seconds,
              c.session_id, c.start_digest, c.lease_owner, c.lease_ttl, c.first_continuation, c.message_id,
              c.routing_key, c.digest, c.default_live_runs, c.default_starts_per_second) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_save_progresses_v2(p_rows intermission_save_v2[])
RETURNS TABLE (n integer, saved_at timestamptz, ending jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_save_v2;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_save_progress_v1(
              c.run_id, c.app, c.tenant, c.owner, c.continuation, c.started, c.done, c.ending, c.approved,
              c.step_count, c.tokens_used) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_pause_runs_v3(p_rows intermission_pause_v3[], p_outbox_hold float8)
RETURNS TABLE (n integer, outcome text, revision bigint, pause suspensions, ending jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_pause_v3;
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_pause_run_v3(c) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_end_runs_v3(p_rows intermission_end_v3[], p_outbox_hold float8)
RETURNS TABLE (n integer, outcome text, revision bigint, ending jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_end_v3;
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_end_run_v3(c) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_request_endings_v2(p_rows intermission_ending_v2[])
RETURNS TABLE (n integer, outcome text, revision bigint, lease_owner text)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_ending_v2;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_request_ending_v1(c.run_id, c.app, c.tenant, c.ending, c.message_id, c.routing_key,
                                              c.digest) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_admit_resumes_v2(p_rows intermission_admission_v2[], p_outbox_hold float8)
RETURNS TABLE (n integer, outcome text, admission resume_admissions, revision bigint, suspension_id bigint,
               expires_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_admission_v2;
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_admit_resume_v1(
              c.run_id, c.app, c.tenant, c.suspension_id, c.revision, c.lease_owner, c.lease_ttl,
              c.first_continuation, c.first_done, c.schema_version, c.input, c.request_digest,
              c.suspension_digest, c.message_id, c.routing_key, c.digest, c.event_message_id,
              c.event_routing_key, c.event_body, c.event_correlation_id, c.event_headers) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_start_resumes_v2(p_rows intermission_resume_start_v2[])
RETURNS TABLE (n integer, outcome text, start resume_starts, expired_at timestamptz, run runs,
               pause suspensions)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_resume_start_v2;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_start_resume_v1(
              c.run_id, c.app, c.tenant, c.suspension_id, c.digest, c.lease_owner, c.lease_ttl,
              c.first_continuation, c.first_done, c.schema_version) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_expire_admissions_v1(p_rows intermission_admission_expiry_v1[])
RETURNS TABLE (n integer, outcome text, expiry resume_expiries)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_admission_expiry_v1;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_expire_admission_v1(c) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_close_resumes_v1(p_rows intermission_closure_v1[], p_outbox_hold float8)
RETURNS TABLE (n integer, outcome text, closure resume_closures, revision bigint)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_closure_v1;
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_close_resume_v1(c) AS x;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_move_deadlines_v2(p_rows intermission_deadline_v2[])
RETURNS TABLE (n integer, outcome text, suspension_id bigint, run_revision bigint, previous timestamptz,
               expires_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_deadline_v2;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        RETURN QUERY SELECT n, x.* FROM intermission_move_deadline_v1(c.run_id, c.app, c.tenant, c.suspension_id, c.extend_by,
                                             c.moved_by) AS x;
    END LOOP;
END;
$$;

-- Each row takes over either the one lapsed run it names (with its first snapshot, or handing the stored one
-- over) or, naming none, up to lapsed_limit lapsed runs of any scope: one output row per run taken, under
-- the position of the row that took it.
CREATE FUNCTION intermission_take_over_v2(p_rows intermission_take_over_v2[])
RETURNS TABLE (n integer, taken_run runs, taken_progress progress)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_take_over_v2;
    i integer := 0;
BEGIN
    FOREACH c IN ARRAY p_rows LOOP
        i := i + 1;
        RETURN QUERY
        SELECT i, t.taken_run, t.taken_progress
          FROM intermission_take_over_v1(c.owner, c.lease_ttl, c.lapsed_limit, c.run_id, c.app, c.tenant,
                                         c.first_continuation, c.first_started, c.first_done, c.first_ending,
                                         c.first_approved) AS t;
    END LOOP;
END;
$$;

-- A second live pause of one run is refused by the unique index: 'exists', and that row writes nothing
-- (its own subtransaction), while the other rows go on. 'created', or 'no_run' (a NULL pause).
CREATE FUNCTION intermission_create_pauses_v2(p_rows intermission_create_pause_v2[])
RETURNS TABLE (n integer, outcome text, pause suspensions)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_create_pause_v2;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        BEGIN
            pause := intermission_create_pause_v1(c.run_id, c.app, c.tenant, c.reason, c.pending, c.continuation,
                                                  c.expires_at, c.ttl, c.checkpoint_id, c.approvers);
            outcome := CASE WHEN pause.id IS NULL THEN 'no_run' ELSE 'created' END;
        EXCEPTION WHEN unique_violation THEN
            pause := NULL;
            outcome := 'exists';
        END;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- The original's plain removals (DeleteSuspension, ProgressStore's delete) and a graceful stop's release of
-- a lease, each by the run's whole key: whether each row found something to act on.
CREATE FUNCTION intermission_delete_pauses_v1(p_rows intermission_run_key_v1[])
RETURNS TABLE (n integer, found boolean)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_run_key_v1;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        DELETE FROM suspensions s WHERE s.run_id = c.run_id AND s.app = c.app AND s.tenant = c.tenant;
        -- Returned as a value, never assigned: an OUT column named found is shadowed by PL/pgSQL's own
        -- FOUND, so `found := FOUND` sets FOUND and the column stays NULL.
        RETURN QUERY SELECT n, FOUND;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_delete_progresses_v1(p_rows intermission_run_key_v1[])
RETURNS TABLE (n integer, found boolean)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_run_key_v1;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        DELETE FROM progress g WHERE g.run_id = c.run_id AND g.app = c.app AND g.tenant = c.tenant;
        -- Returned as a value, never assigned: an OUT column named found is shadowed by PL/pgSQL's own
        -- FOUND, so `found := FOUND` sets FOUND and the column stays NULL.
        RETURN QUERY SELECT n, FOUND;
    END LOOP;
END;
$$;

CREATE FUNCTION intermission_release_leases_v1(p_rows intermission_run_key_v1[])
RETURNS TABLE (n integer, found boolean)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_run_key_v1;
BEGIN
    n := 0;
    FOREACH c IN ARRAY p_rows LOOP
        n := n + 1;
        UPDATE runs r SET lease_expires_at = now()
         WHERE r.id = c.run_id AND r.app = c.app AND r.tenant = c.tenant AND r.state = 'running'
           AND c.owner <> '' AND r.lease_owner = c.owner AND r.lease_expires_at > now();
        -- Returned as a value, never assigned: an OUT column named found is shadowed by PL/pgSQL's own
        -- FOUND, so `found := FOUND` sets FOUND and the column stays NULL.
        RETURN QUERY SELECT n, FOUND;
    END LOOP;
END;
$$;

-- Quarantined outbox rows put back in line (`intermission outbox retry`): each row names one, or NULL for
-- every quarantined row. The ids retried, under the position of the row that retried them.
CREATE FUNCTION intermission_retry_outbox_v1(p_rows intermission_outbox_retry_v1[])
RETURNS TABLE (n integer, id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    c intermission_outbox_retry_v1;
    i integer := 0;
BEGIN
    FOREACH c IN ARRAY p_rows LOOP
        i := i + 1;
        RETURN QUERY
        -- Their message_id, body and last_error stay: a re-publication is the same event, and the last
        -- refusal stays readable until the next one.
        UPDATE outbox o SET quarantined_at = NULL, attempts = 0, next_attempt_at = NULL
         WHERE o.quarantined_at IS NOT NULL AND o.sent_at IS NULL AND (c.id IS NULL OR o.id = c.id)
        RETURNING i, o.id;
    END LOOP;
END;
$$;
