-- Pauses and ends hand their events over too (migration 0009 did it for a claim's run.resumed).
--
-- A Notice and a run.<end> event are completed by their transaction (the pause's id, deadline and
-- checkpoint, the run's new revision), so their writer could not publish them from memory: it did not know
-- them byte for byte, and each went through the relays: a wake-up, a read of the outbox, a publication, a
-- mark. The second versions return the body exactly as their transaction wrote it, and take the outbox
-- hold themselves, so the writer publishes the event right after the commit and marks its row sent, and
-- the relays leave the row alone meanwhile. The row is still written in the transaction and stays the
-- durable record: if the writer dies between the commit and the confirm, the relays publish it once the
-- hold ends, under the same message_id.
--
-- Each is the first version with that added: the hold set first, and the body its outbox insert returns
-- handed back. (A wrapper that called the first version and read the body back by its message_id cost a
-- fifth of an end's time: another function's call and another statement.) p_outbox_hold NULL: no hold,
-- the relays publish the row as before (a writer that does not hand events over). The first versions stay
-- for workers of the previous release during a rolling deploy, until a later migration drops them.

CREATE FUNCTION intermission_pause_run_v2(
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

CREATE FUNCTION intermission_end_run_v2(
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
