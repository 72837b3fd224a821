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
-- refused), and with rows the whole run and pause (composites).
-- writes: outbox, inbox
SELECT c.outcome, c.revision AS r_revision, c.lease_owner AS r_lease_owner,
       c.lease_expires_at AS r_lease_expires_at, c.updated_at AS r_updated_at, c.suspension_id AS s_id,
       c.expires_at AS s_expires_at, c.first_updated_at, c.run, c.pause
  FROM intermission_claim_pause_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_suspension_id => $4, p_revision => $5,
    p_expired_by => $6, p_reason => $7, p_lease_owner => $8, p_lease_ttl => $9, p_first => $10,
    p_first_continuation => $11, p_first_started => $12, p_first_done => $13, p_first_ending => $14,
    p_first_approved => $15, p_drop_pause => $16, p_message_id => $17, p_routing_key => $18,
    p_digest => $19, p_checkpoint_id => $20, p_checkpoint_state => $21, p_decided_by => $22,
    p_decision_reason => $23, p_event_message_id => $24, p_event_routing_key => $25, p_event_body => $26,
    p_event_correlation_id => $27, p_event_headers => $28, p_rows => $29) AS c;
