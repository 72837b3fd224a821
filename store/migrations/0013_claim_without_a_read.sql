-- A resume claims its pause in ONE round trip, without reading it first.
--
-- A command that answers a pause used to read the run and its pause, check itself against them in Python
-- (who may answer; do the answers fit the pending calls) and then claim, pinned to what it read: two round
-- trips and two statements per command, the read also decoding the whole run and pause. For a host's
-- results (run.resume) every check can be stated without the read: the pause must be the pinned one (the
-- claim pins it), of reason external_tool (the claim's p_reason), not expired (the claim checks), and its
-- pending calls must be exactly the answered ones, in the answers' order. That last condition is what this
-- version adds: p_pending_ids, the call ids the claimer answers, in order (a jsonb array; NULL: no such
-- condition, as in the first version). A pause's row never changes after the transaction that wrote it, so
-- the condition is read before the claim takes the run's row lock, and holds for the pause it claims.
--
-- A claim refused here ('answers_mismatch', or any refusal of the first version) is no verdict: the caller
-- takes the checked path (read, check, claim), which names the exact refusal, or claims when the answers
-- merely came in another order than the calls. So this condition may be stricter than the checks in
-- Python, never looser: everything it claims, the checked path would have claimed.
CREATE FUNCTION intermission_claim_pause_v2(
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
    p_pending_ids jsonb,
    OUT outcome text, OUT revision bigint, OUT lease_owner text, OUT lease_expires_at timestamptz,
    OUT updated_at timestamptz, OUT suspension_id bigint, OUT expires_at timestamptz,
    OUT first_updated_at timestamptz, OUT run runs, OUT pause suspensions
) LANGUAGE plpgsql AS $$
DECLARE
    v_claim record;
BEGIN
    IF p_pending_ids IS NOT NULL AND EXISTS (
        SELECT 1 FROM suspensions s
         WHERE s.id = p_suspension_id AND s.run_id = p_run_id AND s.app = p_app AND s.tenant = p_tenant
           AND jsonb_path_query_array(s.pending, '$[*].id') IS DISTINCT FROM p_pending_ids
    ) THEN
        outcome := 'answers_mismatch';
        RETURN;
    END IF;
    SELECT * INTO v_claim FROM intermission_claim_pause_v1(
        p_run_id, p_app, p_tenant, p_suspension_id, p_revision, p_expired_by, p_reason, p_lease_owner,
        p_lease_ttl, p_first, p_first_continuation, p_first_started, p_first_done, p_first_ending,
        p_first_approved, p_drop_pause, p_message_id, p_routing_key, p_digest, p_checkpoint_id,
        p_checkpoint_state, p_decided_by, p_decision_reason, p_event_message_id, p_event_routing_key,
        p_event_body, p_event_correlation_id, p_event_headers, p_rows);
    outcome := v_claim.outcome;
    revision := v_claim.revision;
    lease_owner := v_claim.lease_owner;
    lease_expires_at := v_claim.lease_expires_at;
    updated_at := v_claim.updated_at;
    suspension_id := v_claim.suspension_id;
    expires_at := v_claim.expires_at;
    first_updated_at := v_claim.first_updated_at;
    run := v_claim.run;
    pause := v_claim.pause;
END;
$$;
