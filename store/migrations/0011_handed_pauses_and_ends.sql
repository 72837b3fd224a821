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
-- Each is the first version plus that: it calls it, then reads the body back by the message_id it was
-- given (the row the call just wrote, through its unique index), so there is one definition of the
-- transition. p_outbox_hold NULL: no hold, the relays publish the row as before (a writer that does not
-- hand events over). The first versions stay for workers of the previous release during a rolling deploy.

CREATE FUNCTION intermission_pause_run_v2(
    p_run_id text, p_app text, p_tenant text, p_owner text,
    p_reason suspend_reason, p_pending jsonb, p_continuation jsonb, p_approvers text[], p_ttl float8,
    p_step_count integer, p_tokens_used bigint,
    p_notice jsonb, p_event_message_id uuid, p_event_routing_key text, p_event_correlation_id text,
    p_event_headers jsonb, p_outbox_hold float8,
    OUT revision bigint, OUT pause suspensions, OUT ending jsonb, OUT event_body text
) LANGUAGE plpgsql AS $$
DECLARE
    v_paused record;
BEGIN
    PERFORM intermission_hold_outbox_v1(p_outbox_hold);
    SELECT p.revision, p.pause, p.ending INTO v_paused
      FROM intermission_pause_run_v1(
        p_run_id, p_app, p_tenant, p_owner, p_reason, p_pending, p_continuation, p_approvers, p_ttl,
        p_step_count, p_tokens_used, p_notice, p_event_message_id, p_event_routing_key,
        p_event_correlation_id, p_event_headers) AS p;
    revision := v_paused.revision;
    pause := v_paused.pause;
    ending := v_paused.ending;
    IF revision IS NOT NULL THEN
        SELECT o.body INTO event_body FROM outbox o WHERE o.message_id = p_event_message_id;
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
    SELECT e.revision, e.ending INTO revision, ending
      FROM intermission_end_run_v1(
        p_run_id, p_app, p_tenant, p_owner, p_at_revision, p_state, p_output, p_error, p_messages,
        p_checkpoint_reason, p_run_event_id, p_run_event_kind, p_run_event_data, p_event, p_event_message_id,
        p_event_routing_key, p_event_correlation_id, p_event_headers, p_step_count, p_tokens_used) AS e;
    IF revision IS NOT NULL THEN
        SELECT o.body INTO event_body FROM outbox o WHERE o.message_id = p_event_message_id;
    END IF;
END;
$$;
