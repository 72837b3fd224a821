-- create_pause --
-- A live pause for a run at the exact scope (intermission_create_pause_v1). NULL id: no such run there.
SELECT p.id, p.expires_at, p.created_at
  FROM intermission_create_pause_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_reason => $4, p_pending => $5, p_continuation => $6,
    p_expires_at => $7, p_ttl => $8, p_checkpoint_id => $9, p_approvers => $10) AS p;

-- get_suspension --
-- Read a run's live pause at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT * FROM suspensions WHERE run_id = $1 AND app = $2 AND tenant = $3;

-- delete_suspension --
-- Remove a run's pause at the exact scope. $1 run_id, $2 app, $3 tenant
DELETE FROM suspensions WHERE run_id = $1 AND app = $2 AND tenant = $3 RETURNING id;

-- list_expired --
-- Pauses at the exact scope whose deadline is at or before $3 (and the database clock), soonest first.
-- $1 app, $2 tenant, $3 now, $4 limit (NULL: no limit)
SELECT *
  FROM suspensions
 WHERE app = $1 AND tenant = $2
   AND expires_at IS NOT NULL AND expires_at <= LEAST($3::timestamptz, now())
 ORDER BY expires_at, id
 LIMIT $4;

-- claim_pause --
-- The claim (intermission_claim_pause_v1), for every claimer: the original's plain, expired-by, pinned and
-- leased claims, and the commands that answer a pause with what commits with them. One row: the outcome,
-- the run's new revision and lease and the pause's id and deadline (as claimed, or as they stand when
-- refused), and with rows the whole run and pause (composites). With an outbox hold (seconds; NULL: none) the
-- event it writes waits that long for the relays, since its writer publishes it from memory (migration 0009);
-- the claim is LATERAL to the hold so that the hold is set first.
-- writes: outbox, inbox
SELECT c.outcome, c.revision AS r_revision, c.lease_owner AS r_lease_owner,
       c.lease_expires_at AS r_lease_expires_at, c.updated_at AS r_updated_at, c.suspension_id AS s_id,
       c.expires_at AS s_expires_at, c.first_updated_at, c.run, c.pause
  FROM intermission_hold_outbox_v1(p_outbox_hold => $30) AS h(held)
 CROSS JOIN LATERAL intermission_claim_pause_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_suspension_id => $4, p_revision => $5,
    p_expired_by => $6, p_reason => $7, p_lease_owner => $8, p_lease_ttl => $9, p_first => $10,
    p_first_continuation => $11, p_first_started => $12, p_first_done => $13, p_first_ending => $14,
    p_first_approved => $15, p_drop_pause => $16, p_message_id => $17, p_routing_key => $18,
    p_digest => $19, p_checkpoint_id => $20, p_checkpoint_state => $21, p_decided_by => $22,
    p_decision_reason => $23, p_event_message_id => $24, p_event_routing_key => $25, p_event_body => $26,
    p_event_correlation_id => $27, p_event_headers => $28, p_rows => $29 AND h.held) AS c;

-- claim_pauses --
-- claim_pause for a batch of commands in ONE statement (group commit, consumers/batching.py): one round trip
-- and one commit for the batch. Each array is one of claim_pause's arguments, in claim_pause's order ($1
-- run_ids ... $29 rows; reasons as text), one element per claim. The claims run in the arrays' order (the
-- caller sorts them by run, so that two batches take the runs' row locks in the same order), and each sees
-- what the claims before it wrote: a second command for a pause an earlier one claimed is refused as it
-- would be one after the other, and a message_id twice in one batch is a duplicate the second time. Every
-- claim decides its own outcome; one that raises (a decision on a checkpoint no longer pending) fails the
-- statement, and the caller applies that batch's commands one at a time instead. One row per claim, as
-- claim_pause returns it, with its position n (from 1). $30 the outbox hold, as claim_pause's.
-- writes: outbox, inbox
SELECT a.n, c.outcome, c.revision AS r_revision, c.lease_owner AS r_lease_owner,
       c.lease_expires_at AS r_lease_expires_at, c.updated_at AS r_updated_at, c.suspension_id AS s_id,
       c.expires_at AS s_expires_at, c.first_updated_at, c.run, c.pause
  FROM intermission_hold_outbox_v1($30) AS h(held)
 CROSS JOIN unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::timestamptz[], $7::text[],
              $8::text[], $9::float8[], $10::boolean[], $11::jsonb[], $12::jsonb[], $13::jsonb[], $14::jsonb[],
              $15::jsonb[], $16::boolean[], $17::text[], $18::text[], $19::text[], $20::bigint[], $21::text[],
              $22::text[], $23::text[], $24::uuid[], $25::text[], $26::text[], $27::text[], $28::jsonb[],
              $29::boolean[])
       WITH ORDINALITY AS a(run_id, app, tenant, suspension_id, revision, expired_by, reason, lease_owner,
                            lease_ttl, first, first_continuation, first_started, first_done, first_ending,
                            first_approved, drop_pause, message_id, routing_key, digest, checkpoint_id,
                            checkpoint_state, decided_by, decision_reason, event_message_id,
                            event_routing_key, event_body, event_correlation_id, event_headers, whole, n)
 CROSS JOIN LATERAL intermission_claim_pause_v1(
       a.run_id, a.app, a.tenant, a.suspension_id, a.revision, a.expired_by, a.reason::suspend_reason,
       a.lease_owner, a.lease_ttl, a.first, a.first_continuation, a.first_started, a.first_done, a.first_ending,
       a.first_approved, a.drop_pause, a.message_id, a.routing_key, a.digest, a.checkpoint_id,
       a.checkpoint_state, a.decided_by, a.decision_reason, a.event_message_id, a.event_routing_key,
       a.event_body, a.event_correlation_id, a.event_headers, a.whole AND h.held) AS c
 ORDER BY a.n;

-- move_deadline --
-- An operator moves a live pause's deadline (intermission_move_deadline_v1, migration 0012): later by
-- extend_by seconds, or to now with extend_by NULL, with the run event that records it. One row: the
-- outcome ('moved', 'not_paused', 'pause_changed'), the pause's id, the run's revision, and the deadline
-- before and after.
SELECT m.outcome, m.suspension_id, m.run_revision, m.previous, m.expires_at
  FROM intermission_move_deadline_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_suspension_id => $4, p_extend_by => $5,
    p_moved_by => $6) AS m;
