-- start_run --
-- A new run (intermission_start_run_v2): within the scope's quotas (live runs, starts a second; the
-- scope's own row in scope_quotas, else the defaults given), the command's inbox record (when message_id is
-- set), the run, running under the lease when lease_owner is set, and its first snapshot (when
-- first_continuation is set). One row: the outcome and the run (a composite).
-- writes: inbox
SELECT s.outcome, s.first_updated_at, s.run
  FROM intermission_start_run_v2(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_agent_id => $4, p_input => $5, p_config => $6,
    p_script => $7, p_pause_ttl_seconds => $8, p_session_id => $9, p_start_digest => $10,
    p_lease_owner => $11, p_lease_ttl => $12, p_first_continuation => $13,
    p_message_id => $14, p_routing_key => $15, p_digest => $16,
    p_default_live_runs => $17, p_default_starts_per_second => $18) AS s;

-- set_quota --
-- A scope's own quotas (NULL: the fleet's default). $1 app, $2 tenant, $3 live runs, $4 starts a second
INSERT INTO scope_quotas (app, tenant, live_runs, starts_per_second)
VALUES ($1, $2, $3, $4)
ON CONFLICT (app, tenant) DO UPDATE
   SET live_runs = EXCLUDED.live_runs, starts_per_second = EXCLUDED.starts_per_second, updated_at = now()
RETURNING app, tenant, live_runs, starts_per_second;

-- list_quotas --
-- Every scope's own quotas, with its live runs now.
SELECT q.app, q.tenant, q.live_runs, q.starts_per_second,
       (SELECT count(*) FROM runs r WHERE r.app = q.app AND r.tenant = q.tenant AND r.ended_at IS NULL) AS live
  FROM scope_quotas q
 ORDER BY q.app, q.tenant;

-- get_run --
-- Read a run at the exact scope. $1 id, $2 app, $3 tenant
SELECT * FROM runs WHERE id = $1 AND app = $2 AND tenant = $3;

-- renew_lease --
-- Extend a live lease held by $4, by the database clock. $1 id, $2 app, $3 tenant, $4 owner, $5 ttl seconds
UPDATE runs
   SET lease_expires_at = now() + make_interval(secs => $5::float8)
 WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running'
   AND $4::text <> '' AND lease_owner = $4 AND lease_expires_at > now()
RETURNING lease_expires_at;

-- release_lease --
-- Let a held lease lapse now, so another worker may take the run over at once.
-- $1 id, $2 app, $3 tenant, $4 owner
UPDATE runs
   SET lease_expires_at = now()
 WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running'
   AND $4::text <> '' AND lease_owner = $4 AND lease_expires_at > now()
RETURNING id;

-- take_over --
-- A takeover (intermission_take_over_v1): the run run_id at its exact scope, or, with run_id NULL, up to
-- limit lapsed runs of every scope. One row per run taken: the run and its progress (composites).
SELECT t.taken_run AS run, t.taken_progress AS progress
  FROM intermission_take_over_v1(
    p_owner => $1, p_lease_ttl => $2, p_limit => $3, p_run_id => $4, p_app => $5, p_tenant => $6,
    p_first_continuation => $7, p_first_started => $8, p_first_done => $9, p_first_ending => $10,
    p_first_approved => $11) AS t;

-- pause_run --
-- A running run pauses (intermission_pause_run_v2). One row: the new revision, the pause as written (a
-- composite) and the Notice's body as written, all NULL when owner does not hold the run or the run was
-- asked to end (then ending says how). With an outbox hold (seconds; NULL: none) the Notice's row waits
-- that long for the relays, since its writer publishes it from memory (migration 0011).
-- writes: outbox
SELECT p.revision, p.pause, p.ending, p.event_body
  FROM intermission_pause_run_v2(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_owner => $4, p_reason => $5, p_pending => $6,
    p_continuation => $7, p_approvers => $8, p_ttl => $9, p_step_count => $10, p_tokens_used => $11,
    p_notice => $12, p_event_message_id => $13, p_event_routing_key => $14, p_event_correlation_id => $15,
    p_event_headers => $16, p_outbox_hold => $17) AS p;

-- end_run --
-- A running run ends (intermission_end_run_v2). One row: the new revision and the run.* event's body as
-- written, or NULL when the run is not held as the arguments say or was asked to end otherwise (then ending
-- says how). With an outbox hold (seconds; NULL: none) the event's row waits that long for the relays,
-- since its writer publishes it from memory (migration 0011).
-- writes: outbox
SELECT e.revision, e.ending, e.event_body
  FROM intermission_end_run_v2(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_owner => $4, p_at_revision => $5, p_state => $6,
    p_output => $7, p_error => $8, p_messages => $9, p_checkpoint_reason => $10, p_run_event_id => $11,
    p_run_event_kind => $12, p_run_event_data => $13, p_event => $14, p_event_message_id => $15,
    p_event_routing_key => $16, p_event_correlation_id => $17, p_event_headers => $18,
    p_step_count => $19, p_tokens_used => $20, p_outbox_hold => $21) AS e;

-- end_runs --
-- end_run for several runs at once, in ONE statement (store/coalesce.py: runs that reach their end at the same
-- moment share one round trip and one commit; each run's end is still all-or-nothing, inside it). Each array
-- is one of end_run's arguments in end_run's order ($1 run_ids ... $21 outbox holds; states as text), one
-- element per run; the ends run in the arrays' order (the caller sorts them by run). One row per run, as
-- end_run returns it, with its position n (from 1).
-- writes: outbox
SELECT a.n, e.revision, e.ending, e.event_body
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::text[], $8::text[],
              $9::jsonb[], $10::text[], $11::uuid[], $12::text[], $13::jsonb[], $14::jsonb[], $15::uuid[],
              $16::text[], $17::text[], $18::jsonb[], $19::int[], $20::bigint[], $21::float8[])
       WITH ORDINALITY AS a(run_id, app, tenant, owner, at_revision, state, output, error, messages,
                            checkpoint_reason, run_event_id, run_event_kind, run_event_data, event,
                            event_message_id, event_routing_key, event_correlation_id, event_headers,
                            step_count, tokens_used, outbox_hold, n)
 CROSS JOIN LATERAL intermission_end_run_v2(
       a.run_id, a.app, a.tenant, a.owner, a.at_revision, a.state::run_state, a.output, a.error, a.messages,
       a.checkpoint_reason, a.run_event_id, a.run_event_kind, a.run_event_data, a.event, a.event_message_id,
       a.event_routing_key, a.event_correlation_id, a.event_headers, a.step_count, a.tokens_used,
       a.outbox_hold) AS e
 ORDER BY a.n;

-- list_run_events --
-- A run's metadata events in order, at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT event_id, kind, revision, data, created_at
  FROM run_events
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY id;
