-- Every state transition of a run, written ONCE, as a versioned function with named parameters.
--
-- Each function is the whole transition: the conditional write that decides it and everything that
-- commits with it (lease, first progress snapshot, inbox record, outbox event, metadata event), as one
-- statement whose parts hang off that write; and, when it does not apply, the classification of why, read
-- on the failure path only. The store calls each with named arguments in ONE round trip (a single
-- statement is its own transaction), and every path that needs a transition calls the same function:
-- there is no fast path beside a fallback.
--
-- Why functions (docs/decisions.md has the whole argument): one definition that every path reuses, named
-- parameters instead of $16, a refusal classified next to the write it explains, one round trip per
-- transition, and versioned names. A function is never edited once released: a changed transition is a
-- new function (_v2) added beside the old one, so workers of two releases can share the database during a
-- rolling deploy, and the old one is dropped by a later migration.
--
-- Refusals are RETURNED as an outcome, never raised, so a caller can decide each command independently. A
-- refusal leaves nothing written: where a transition records something before it knows the outcome (the
-- inbox row that orders concurrent duplicates), it removes that record again. Only a state the fleet never
-- produces (a pending checkpoint missing under a live pause) raises, which rolls the whole transition back.
--
-- All of them are plpgsql, which keeps the plans of its statements for the session (a LANGUAGE sql
-- function that writes plans its statements again on every call). Mind that a row value IS NOT NULL only
-- when every one of its fields is: whether a row was found is asked of its key.

-- An end asked of a RUNNING run (run.cancel while it runs), kept on the run's own row: every writer of a
-- running run (progress save, pause, end, lease renewal) writes or locks this row, so each one sees the
-- request under the row lock, whenever it committed (a condition on another table would be judged by the
-- writer's older snapshot and miss a request that committed while it waited). It is set once, by
-- intermission_request_ending_v1, and goes with the run's end; a run never pauses with one.
ALTER TABLE runs ADD COLUMN ending jsonb;
ALTER TABLE runs ADD CONSTRAINT runs_ending_only_running CHECK (ending IS NULL OR state = 'running');

-- The progress upsert: the one place a snapshot is written. Callers hold the run (its row locked by their
-- claim, or by their save under a live lease). An ending the snapshot row already has is kept, whatever the
-- writer sends: once a run was asked to end (a claim's ending, a cancel while it ran), no later snapshot of
-- its holder, who may not know yet, can take the request back.
CREATE FUNCTION intermission_write_progress_v1(
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
    ON CONFLICT (run_id) DO UPDATE
       SET app = excluded.app, tenant = excluded.tenant, owner = excluded.owner,
           continuation = excluded.continuation, started = excluded.started, done = excluded.done,
           ending = COALESCE(p.ending, excluded.ending), approved = excluded.approved,
           updated_at = excluded.updated_at
    RETURNING p.updated_at INTO v_updated_at;
    RETURN v_updated_at;
END;
$$;

-- SaveProgress: the snapshot, only while the run is running under p_owner's live lease, with the run's
-- step and token counts (p_step_count, p_tokens_used: the run row is right after every boundary, not only
-- at a pause). Writing the counts takes the run's row lock, so a takeover that commits first is seen (the
-- re-check finds another owner) and one that comes second waits for this write. An empty owner never
-- matches. saved_at NULL: the lease is not held, and nothing was written. ending: the end asked of the run
-- while it ran (runs.ending), which the holder must now finish; the snapshot keeps it.
CREATE FUNCTION intermission_save_progress_v1(
    p_run_id text, p_app text, p_tenant text, p_owner text,
    p_continuation jsonb, p_started jsonb, p_done jsonb, p_ending jsonb, p_approved jsonb,
    p_step_count integer, p_tokens_used bigint,
    OUT saved_at timestamptz, OUT ending jsonb
) LANGUAGE plpgsql AS $$
BEGIN
    WITH holder AS (
        UPDATE runs r
           SET step_count = p_step_count, tokens_used = p_tokens_used
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND p_owner <> '' AND r.lease_owner = p_owner AND r.lease_expires_at > now()
        RETURNING r.id, r.ending
    )
    SELECT intermission_write_progress_v1(p_run_id, p_app, p_tenant, p_owner, p_continuation, p_started,
                                          p_done, p_ending, p_approved), h.ending
      INTO saved_at, ending
      FROM holder h;
END;
$$;

-- The inbox record of a delivered command, written FIRST, so a duplicate delivered concurrently waits on the
-- unique index until the first commits (and is then a duplicate) or is refused (and then applies itself).
-- The inbox is keyed by (app, tenant, message_id) (migration 0007): a message_id is an idempotency key
-- within its scope, so every transition records, looks up and removes a record under the scope it is
-- called at, and one tenant's command never pre-empts another's that happens to use the same id.
-- What a message_id that is recorded already at the scope means: 'duplicate' (the same command was applied
-- before) or 'message_id_conflict' (that message_id was used there for a different command).
CREATE FUNCTION intermission_recorded_command_v1(
    p_app text, p_tenant text, p_message_id text, p_routing_key text, p_digest text
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_before inbox;
BEGIN
    SELECT i.* INTO v_before FROM inbox i
     WHERE i.app = p_app AND i.tenant = p_tenant AND i.message_id = p_message_id;
    IF v_before.body_digest = p_digest AND v_before.routing_key = p_routing_key THEN
        RETURN 'duplicate';
    END IF;
    RETURN 'message_id_conflict';
END;
$$;

-- The claim: the atomic paused -> running move, with the revision bumped, for every claimer there is: the
-- seed's plain, expired-by, pinned and leased claims, a command that answers a pause (run.resume,
-- run.decide, run.expire, run.cancel) and an agent reply's admission.
--
-- Pinned (p_suspension_id and p_revision set): only that pause at that revision, so a later pause of the
-- same run never satisfies an older claim. Unpinned: the run's pause at the revision it has as this
-- function begins; a claimer that waits while the run is claimed AND paused again finds 'paused' once
-- more, but not at the revision it read, so it never takes the new pause.
-- p_expired_by NULL claims only an unexpired pause; set, only one whose deadline passed by it AND by the
-- database clock. The two predicates partition the same stored expires_at, so a resume and a sweep are
-- exclusive. p_reason, when set, claims only a pause of that reason (an agent reply's admission).
-- p_lease_owner NULL claims without a lease (the original's plain claims).
--
-- What commits with the claim, each part only when its arguments are set:
--   p_message_id ...        the command's inbox record at the claim's scope, written first (a message_id
--                           recorded there before claims nothing: 'duplicate' or 'message_id_conflict');
--   p_first ...             the first progress snapshot under the new lease; a NULL p_first_continuation
--                           takes the claimed pause's own continuation;
--   p_drop_pause            the removal of the answered pause;
--   p_checkpoint_id ...     the approval decision on the pause's checkpoint;
--   p_event_message_id ...  an outbox event (run.resumed).
-- It returns the claimed run's new revision and lease and the pause's id and deadline; the whole run and
-- pause rows (run, pause) only with p_rows.
--
-- Every claimer contends on the run's row lock and re-checks state and revision after the winner commits,
-- so exactly one wins. A claim that matches nothing reads the run and its live pause again (a new
-- snapshot, which sees the winner) and says why: not_suspended, run_conflict (paused on another pause or
-- revision than pinned), wrong_reason, suspension_expired, not_expired (for p_expired_by) or lost (paused
-- as pinned and in time, yet unmatched: somebody else claimed it between the two reads).
CREATE FUNCTION intermission_claim_pause_v1(
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
          FROM suspensions s JOIN claimed c ON s.run_id = c.id
    ), first AS (
        SELECT intermission_write_progress_v1(
                   c.id, c.app, c.tenant, p_lease_owner, COALESCE(p_first_continuation, a.continuation),
                   p_first_started, p_first_done, p_first_ending, p_first_approved) AS updated_at
          FROM claimed c, answered a
         WHERE p_first
    ), dropped AS (
        DELETE FROM suspensions s USING claimed c WHERE p_drop_pause AND s.run_id = c.id
    ), decided AS (
        UPDATE checkpoints k
           SET state = p_checkpoint_state, decided_by = p_decided_by, reason = p_decision_reason,
               decided_at = now()
          FROM claimed c
         WHERE p_checkpoint_id IS NOT NULL AND k.id = p_checkpoint_id AND k.run_id = c.id AND k.state = 'pending'
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

-- A new run (run.start), as ONE transition: the command's inbox record (when p_message_id is set), the
-- run (running under the lease when p_lease_owner is set, else created) and its first snapshot (when
-- p_first_continuation is set). The caller picks the run id: the identical start again is 'exists_same'
-- and changes nothing; a different one under that id (in any scope) is 'run_exists'. Outcomes: 'created',
-- those two, or the inbox record's 'duplicate' / 'message_id_conflict'.
CREATE FUNCTION intermission_start_run_v1(
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
        ON CONFLICT (id) DO NOTHING
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
    SELECT r.* INTO run FROM runs r WHERE r.id = p_run_id;
    IF run.start_digest = p_start_digest AND run.app = p_app AND run.tenant = p_tenant THEN
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

-- A live pause for a run at the exact scope: the original's CreateSuspension. The deadline is the database
-- clock plus p_ttl when it is set, else p_expires_at as given. NULL when the run is not at that scope.
CREATE FUNCTION intermission_create_pause_v1(
    p_run_id text, p_app text, p_tenant text, p_reason suspend_reason, p_pending jsonb, p_continuation jsonb,
    p_expires_at timestamptz, p_ttl float8, p_checkpoint_id bigint, p_approvers text[]
) RETURNS suspensions LANGUAGE plpgsql AS $$
DECLARE
    v_pause suspensions;
BEGIN
    INSERT INTO suspensions (run_id, app, tenant, reason, pending, continuation, expires_at, checkpoint_id,
                             approvers)
    SELECT r.id, r.app, r.tenant, p_reason, p_pending, p_continuation,
           CASE WHEN p_ttl IS NULL THEN p_expires_at ELSE now() + make_interval(secs => p_ttl) END,
           p_checkpoint_id, p_approvers
      FROM runs r
     WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant
    RETURNING * INTO v_pause;
    RETURN v_pause;
END;
$$;

-- A running run pauses, as ONE transition, only by the holder of its live lease: the run moves to paused
-- (revision + 1, lease cleared, step and token counts recorded), any old pause is removed, the new pause
-- and, for an approval, its pending checkpoint are written, the progress is dropped, the metadata event and
-- the Notice are written. p_ttl NULL takes the run's own pause_ttl_seconds; 0 means no deadline. A run
-- asked to end while it ran (runs.ending) does not pause: nothing is written and ending says what its
-- holder must finish instead.
-- p_notice is the Notice as the caller knows it; the values only this transaction knows (the pause's id,
-- its deadline, its checkpoint, the run's new revision) are added to it here. The pause's id is drawn
-- first, so the pause and its checkpoint can name each other in one statement. A NULL revision: the lease
-- is not held, and nothing was written.
CREATE FUNCTION intermission_pause_run_v1(
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
        DELETE FROM suspensions s USING drawn d WHERE s.run_id = d.id
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
        DELETE FROM progress g USING drawn d WHERE g.run_id = d.id
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

-- A running run ends (completed, failed, cancelled, or failed by an expiry or a closure), as ONE
-- transition: the terminal state (revision + 1, lease cleared), the run's own messages appended to its
-- session (p_messages, never its loaded history), its progress and any pause removed, its undecided
-- checkpoints closed, the metadata event (p_run_event_*) and the run.* event. p_event is that event as the
-- caller knows it; the run's new revision is added here.
--
-- Who may end it: the holder of its live lease (p_owner; an empty owner never matches). With p_owner NULL,
-- only a closure under host proof, which holds the run's row lock and binds the revision it checked
-- (p_at_revision, required then and ignored otherwise). revision NULL: the run is not held as that says,
-- and nothing was written. A holder's end of a run asked to end while it ran (runs.ending, a cancel) must
-- be that end: any other (completed, failed) writes nothing, and ending says what to end it as instead. A
-- closure is a host's own decision under proof and is not turned aside.
--
-- p_step_count and p_tokens_used are the run's counts at its end (NULL keeps those stored).
CREATE FUNCTION intermission_end_run_v1(
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
        DELETE FROM progress g USING ended e WHERE g.run_id = e.id
    ), no_pause AS (
        DELETE FROM suspensions s USING ended e WHERE s.run_id = e.id
    ), closed AS (
        UPDATE checkpoints k SET state = 'rejected', reason = p_checkpoint_reason, decided_at = now()
          FROM ended e
         WHERE k.run_id = e.id AND k.state = 'pending'
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

-- A cancel of a RUNNING run (run.cancel while the run runs), as ONE transition: the ending recorded on the
-- run's row (runs.ending, the fence every writer of the running run meets under the row lock) and in its
-- snapshot (progress.ending, what a takeover finishes), with the command's inbox record. Nothing ends here:
-- the lease holder finishes the end at its next boundary (it hears of it from its next progress save or
-- lease renewal), and a worker that takes the run over after its holder died finishes it the same way.
-- Outcomes: 'requested'; 'ending_before' (an end was asked or claimed already, and this command is
-- recorded as applied: the run is ending); 'not_running' (not running at that scope any more, or never:
-- the caller reads it again); 'not_leased' (running under the original's plain claim, which holds no lease:
-- nobody here could finish an end, so nothing is asked); the inbox's 'duplicate' or 'message_id_conflict'.
CREATE FUNCTION intermission_request_ending_v1(
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
           AND NOT EXISTS (SELECT 1 FROM progress g WHERE g.run_id = r.id AND g.ending IS NOT NULL)
           AND (p_message_id IS NULL OR EXISTS (SELECT 1 FROM recorded))
        RETURNING r.id, r.revision, r.lease_owner
    ), noted AS (
        UPDATE progress g SET ending = p_ending FROM asked a WHERE g.run_id = a.id AND g.ending IS NULL
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

-- A takeover: a running run whose lease lapsed passes to p_owner under a new lease, with its progress
-- snapshot: adopted as it stands, or replaced by the first snapshot when p_first_continuation is set. The
-- revision does not change: a lease is not a state. With p_run_id set, that run at that exact scope
-- (ClaimContinuationLeased): a takeover racing the holder's last write waits for it and re-checks.
-- Without, up to p_limit lapsed runs of EVERY scope, skipping rows another worker is taking right now (the
-- reclaim sweep).
--
-- Only a lease that LAPSED is taken (lease_expires_at <= now(), so never NULL): a run the original's plain
-- claim moved to running holds no lease at all, and belongs to that claimer, who never promised to renew
-- anything. Adopting it as "lapsed" would run its continuation a second time beside the claimer's.
CREATE FUNCTION intermission_take_over_v1(
    p_owner text, p_lease_ttl float8, p_limit integer,
    p_run_id text, p_app text, p_tenant text,
    p_first_continuation jsonb, p_first_started jsonb, p_first_done jsonb, p_first_ending jsonb,
    p_first_approved jsonb
) RETURNS TABLE (taken_run runs, taken_progress progress) LANGUAGE plpgsql AS $$
DECLARE
    v_taken text[];
BEGIN
    IF p_run_id IS NOT NULL THEN
        UPDATE runs r
           SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_ttl),
               updated_at = now()
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'running'
           AND r.lease_expires_at <= now()
        RETURNING ARRAY[r.id] INTO v_taken;
    ELSE
        WITH lapsed AS (
            SELECT r.id FROM runs r
             WHERE r.state = 'running' AND r.lease_expires_at <= now()
             ORDER BY r.lease_expires_at
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED
        ), moved AS (
            UPDATE runs r
               SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_ttl),
                   updated_at = now()
              FROM lapsed
             WHERE r.id = lapsed.id
            RETURNING r.id
        )
        SELECT array_agg(m.id) INTO v_taken FROM moved m;
    END IF;
    IF v_taken IS NULL THEN
        RETURN;
    END IF;
    IF p_first_continuation IS NOT NULL THEN
        PERFORM intermission_write_progress_v1(p_run_id, p_app, p_tenant, p_owner, p_first_continuation,
                                               p_first_started, p_first_done, p_first_ending, p_first_approved);
    ELSE
        -- The snapshot belongs to whoever holds the run: it goes over with the lease.
        UPDATE progress g SET owner = p_owner, updated_at = now() WHERE g.run_id = ANY (v_taken);
    END IF;
    RETURN QUERY
    SELECT r, g FROM runs r LEFT JOIN progress g ON g.run_id = r.id WHERE r.id = ANY (v_taken);
END;
$$;

-- An agent reply's admission (AdmitResume[Leased]), as ONE transition: the claim of the pinned agent_reply
-- pause (kept, not removed: StartResume hands it over and discovery lists it), under the lease with its
-- first snapshot when p_lease_owner is set, with its run.resumed event, and the admission with the reply's
-- exact bytes. An admission recorded for this pause before is returned as it is ('admitted_before') when
-- its request digest is p_request_digest, or is 'resume_admission_conflict', and takes nothing, even if
-- some writer has since put the run back on this very pause. A claim that loses to a rival admission of
-- the same pause gets that admission back the same way. Other refusals are the claim's outcomes.
--
-- p_message_id ... is the delivering command's inbox record (run.reply), written with the claim. A
-- message_id recorded at this scope for a DIFFERENT command is 'message_id_conflict' before anything else,
-- even when the pause was admitted since: the same id must not stand for two requests. Recorded for this
-- very reply, it is no refusal: the reply's idempotency record is its admission, and a redelivery must
-- still be able to reach the start its first delivery did not.
CREATE FUNCTION intermission_admit_resume_v1(
    p_run_id text, p_app text, p_tenant text, p_suspension_id bigint, p_revision bigint,
    p_lease_owner text, p_lease_ttl float8,
    p_first_continuation jsonb, p_first_done jsonb,
    p_schema_version integer, p_input bytea, p_request_digest text, p_suspension_digest text,
    p_message_id text, p_routing_key text, p_digest text,
    p_event_message_id uuid, p_event_routing_key text, p_event_body text, p_event_correlation_id text,
    p_event_headers jsonb,
    OUT outcome text, OUT admission resume_admissions,
    OUT revision bigint, OUT suspension_id bigint, OUT expires_at timestamptz
) LANGUAGE plpgsql AS $$
DECLARE
    v_claim record;
BEGIN
    IF p_message_id IS NOT NULL
       AND EXISTS (SELECT 1 FROM inbox i
                    WHERE i.app = p_app AND i.tenant = p_tenant AND i.message_id = p_message_id)
       AND intermission_recorded_command_v1(p_app, p_tenant, p_message_id, p_routing_key, p_digest)
           = 'message_id_conflict' THEN
        outcome := 'message_id_conflict';
        RETURN;
    END IF;
    FOR attempt IN 1..2 LOOP
        SELECT a.* INTO admission FROM resume_admissions a
         WHERE a.run_id = p_run_id AND a.suspension_id = p_suspension_id AND a.app = p_app
           AND a.tenant = p_tenant;
        IF FOUND THEN
            outcome := CASE WHEN admission.request_digest = p_request_digest THEN 'admitted_before'
                            ELSE 'resume_admission_conflict' END;
            RETURN;
        END IF;
        IF attempt = 2 THEN
            -- The claim matched nothing and no rival admitted this pause: the claim's refusal stands.
            RETURN;
        END IF;
        SELECT * INTO v_claim FROM intermission_claim_pause_v1(
            p_run_id => p_run_id, p_app => p_app, p_tenant => p_tenant,
            p_suspension_id => p_suspension_id, p_revision => p_revision,
            p_expired_by => NULL, p_reason => 'agent_reply',
            p_lease_owner => p_lease_owner, p_lease_ttl => p_lease_ttl,
            p_first => p_first_continuation IS NOT NULL, p_first_continuation => p_first_continuation,
            p_first_started => NULL, p_first_done => p_first_done, p_first_ending => NULL,
            p_first_approved => NULL, p_drop_pause => false,
            p_message_id => p_message_id, p_routing_key => p_routing_key, p_digest => p_digest,
            p_checkpoint_id => NULL, p_checkpoint_state => NULL, p_decided_by => NULL, p_decision_reason => NULL,
            p_event_message_id => p_event_message_id, p_event_routing_key => p_event_routing_key,
            p_event_body => p_event_body, p_event_correlation_id => p_event_correlation_id,
            p_event_headers => p_event_headers, p_rows => false);
        outcome := v_claim.outcome;
        -- The run and its pause as the claim found them: the words of a refusal.
        revision := v_claim.revision;
        suspension_id := v_claim.suspension_id;
        expires_at := v_claim.expires_at;
        EXIT WHEN outcome = 'claimed';
        IF outcome = 'message_id_conflict' THEN
            -- A rival with this message_id but another body committed first.
            RETURN;
        END IF;
        -- Lost or refused ('duplicate' included: this very reply, delivered twice at once, committed first):
        -- perhaps because this pause was admitted meanwhile (by this request's earlier attempt, or by a rival
        -- that won the row lock; its admission is committed by now). Look again.
    END LOOP;

    INSERT INTO resume_admissions (run_id, suspension_id, app, tenant, schema_version, pinned_revision, input,
                                   request_digest, suspension_digest, claimed_revision)
    VALUES (p_run_id, p_suspension_id, p_app, p_tenant, p_schema_version, p_revision, p_input,
            p_request_digest, p_suspension_digest, v_claim.revision)
    RETURNING * INTO admission;
    outcome := 'admitted';
END;
$$;

-- The single grant to execute an admitted resume (StartResume[Leased]), as ONE transition under the run's
-- row lock, which every run writer takes and which expiry takes too, so a start and an expiry of one
-- admission can never both commit. Outcomes, checked in this order: 'no_admission', 'digest_conflict'
-- (p_digest is not the admission's), 'started_before' (the recorded start is returned as it is and takes
-- nothing), 'expired' (the admission's expiry proved the continuation must not run), 'run_conflict' (the
-- run is not running at the revision the admission claimed), 'pause_gone' (nothing left to hand over),
-- else 'started': the lease moves to p_lease_owner (whoever held it; the revision stays the admission's
-- claimed_revision) with the first snapshot, the start is recorded, and the run and the pause are
-- returned: the execution right.
CREATE FUNCTION intermission_start_resume_v1(
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
         WHERE r.id = p_run_id
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
