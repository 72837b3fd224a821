-- create_run --
-- Create a run, running under a lease when $11 is set (else created). A run id that exists already
-- inserts nothing and returns nothing. $1 id, $2 app, $3 tenant, $4 agent_id, $5 input, $6 config,
-- $7 script, $8 pause_ttl_seconds, $9 session_id, $10 start_digest, $11 lease owner, $12 lease ttl seconds
INSERT INTO runs (id, app, tenant, agent_id, input, config, script, pause_ttl_seconds, session_id,
                  start_digest, state, lease_owner, lease_expires_at)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7::jsonb, $8, $9, $10,
        CASE WHEN $11::text IS NULL THEN 'created'::run_state ELSE 'running'::run_state END,
        $11::text,
        CASE WHEN $11::text IS NULL THEN NULL ELSE now() + make_interval(secs => $12::float8) END)
ON CONFLICT (id) DO NOTHING
RETURNING id, app, tenant, agent_id, state, revision, lease_owner, lease_expires_at, input, output, error,
          session_id, config, script, pause_ttl_seconds, step_count, tokens_used, created_at, updated_at;

-- get_run --
-- Read a run at the exact scope. $1 id, $2 app, $3 tenant
SELECT id, app, tenant, agent_id, state, revision, lease_owner, lease_expires_at, input, output, error,
       session_id, config, script, pause_ttl_seconds, step_count, tokens_used, created_at, updated_at
  FROM runs
 WHERE id = $1 AND app = $2 AND tenant = $3;

-- run_start_digest --
-- The stored start digest and scope of a run id, whatever its scope. $1 id
SELECT app, tenant, start_digest FROM runs WHERE id = $1;

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

-- claim_continuation_leased --
-- Take over a running run whose lease lapsed (or that holds none), under a new lease. The revision does
-- not change: a lease is not a state. $1 id, $2 app, $3 tenant, $4 owner, $5 ttl seconds
UPDATE runs
   SET lease_owner = $4, lease_expires_at = now() + make_interval(secs => $5::float8), updated_at = now()
 WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running'
   AND (lease_expires_at IS NULL OR lease_expires_at <= now())
RETURNING id, app, tenant, agent_id, state, revision, lease_owner, lease_expires_at, input, output, error,
          session_id, config, script, pause_ttl_seconds, step_count, tokens_used, created_at, updated_at;

-- reclaim_lapsed --
-- The second cross-scope read, for the reclaim sweep only: take up to $3 running runs whose lease lapsed,
-- skipping rows another worker is taking right now, under a new lease. $1 owner, $2 ttl seconds, $3 limit
WITH lapsed AS (
    SELECT id FROM runs
     WHERE state = 'running' AND (lease_expires_at IS NULL OR lease_expires_at <= now())
     ORDER BY lease_expires_at NULLS FIRST
     LIMIT $3
       FOR UPDATE SKIP LOCKED
)
UPDATE runs r
   SET lease_owner = $1, lease_expires_at = now() + make_interval(secs => $2::float8), updated_at = now()
  FROM lapsed
 WHERE r.id = lapsed.id
RETURNING r.id, r.app, r.tenant, r.agent_id, r.state, r.revision, r.lease_owner, r.lease_expires_at,
          r.input, r.output, r.error, r.session_id, r.config, r.script, r.pause_ttl_seconds, r.step_count,
          r.tokens_used, r.created_at, r.updated_at;

-- pause_run --
-- Move a running run held by $4 to paused: revision + 1, lease cleared. $1 id, $2 app, $3 tenant,
-- $4 owner, $5 step_count, $6 tokens_used
UPDATE runs
   SET state = 'paused', revision = revision + 1, lease_owner = NULL, lease_expires_at = NULL,
       step_count = $5, tokens_used = $6, updated_at = now()
 WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running'
   AND $4::text <> '' AND lease_owner = $4 AND lease_expires_at > now()
RETURNING revision, pause_ttl_seconds;

-- end_run --
-- End a running run held by $4: the terminal state, revision + 1, lease cleared. $1 id, $2 app,
-- $3 tenant, $4 owner, $5 state, $6 output, $7 error
UPDATE runs
   SET state = $5::run_state, revision = revision + 1, lease_owner = NULL, lease_expires_at = NULL,
       output = $6, error = $7, updated_at = now(), ended_at = now()
 WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running'
   AND $4::text <> '' AND lease_owner = $4 AND lease_expires_at > now()
RETURNING revision, session_id;

-- delete_run_suspension --
-- Remove whatever pause a run holds (the old one, before a new pause or an end). $1 run_id
DELETE FROM suspensions WHERE run_id = $1;

-- insert_checkpoint --
-- The decision point of an approval pause. $1 run_id, $2 suspension_id, $3 app, $4 tenant, $5 approvers
INSERT INTO checkpoints (run_id, suspension_id, app, tenant, approvers)
VALUES ($1, $2, $3, $4, $5::text[])
RETURNING id;

-- set_suspension_checkpoint --
-- Link a pause to its checkpoint. $1 suspension_id, $2 checkpoint_id
UPDATE suspensions SET checkpoint_id = $2 WHERE id = $1;

-- close_pending_checkpoints --
-- Resolve a run's undecided checkpoints, as a cancel or an expiry does. $1 run_id, $2 state, $3 reason
UPDATE checkpoints
   SET state = $2, reason = $3, decided_at = now()
 WHERE run_id = $1 AND state = 'pending';

-- insert_run_event --
-- A metadata event, in the transaction of the change it describes. $1 event_id, $2 run_id, $3 app,
-- $4 tenant, $5 kind, $6 revision, $7 data
INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb);

-- list_run_events --
-- A run's metadata events in order, at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT event_id, kind, revision, data, created_at
  FROM run_events
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY id;

-- end_run_at_once --
-- end_run and everything its transaction writes, as ONE statement (its own transaction): the terminal
-- state (revision + 1, lease cleared), the run's own messages appended to its session (when $9 is set), its
-- progress and any pause removed, undecided checkpoints closed, the metadata event and the run.* event.
-- Every write hangs off the ended row, so an end that matches nothing writes nothing and returns no row.
-- Pinned to the revision the caller holds ($8), so the caller knows the new revision ($8 + 1) before it
-- writes the event body; an end that finds another revision matches nothing and the caller takes the
-- step-by-step path. $1 id, $2 app, $3 tenant, $4 owner, $5 state, $6 output, $7 error, $8 revision,
-- $9 own messages (NULL: none), $10 checkpoint reason, $11 run event id, $12 run event kind,
-- $13 run event data, $14 outbox message_id, $15 outbox routing_key, $16 outbox body,
-- $17 outbox correlation_id, $18 outbox headers
WITH ended AS (
    UPDATE runs
       SET state = $5::run_state, revision = revision + 1, lease_owner = NULL, lease_expires_at = NULL,
           output = $6, error = $7, updated_at = now(), ended_at = now()
     WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running'
       AND $4::text <> '' AND lease_owner = $4 AND lease_expires_at > now()
       AND revision = $8
    RETURNING id, app, tenant, revision, session_id
), saved AS (
    INSERT INTO session_messages (app, tenant, session_id, run_id, message)
    SELECT e.app, e.tenant, e.session_id, e.id, t.m
      FROM ended e, jsonb_array_elements($9::jsonb) WITH ORDINALITY AS t (m, n)
     WHERE $9::jsonb IS NOT NULL
     ORDER BY t.n
), no_progress AS (
    DELETE FROM progress p USING ended e WHERE p.run_id = e.id
), no_pause AS (
    DELETE FROM suspensions s USING ended e WHERE s.run_id = e.id
), closed AS (
    UPDATE checkpoints k
       SET state = 'rejected', reason = $10, decided_at = now()
      FROM ended e
     WHERE k.run_id = e.id AND k.state = 'pending'
), noted AS (
    INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
    SELECT $11::uuid, e.id, e.app, e.tenant, $12::text, e.revision, $13::jsonb FROM ended e
), announced AS (
    INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
    SELECT $14::uuid, $15::text, $16::text, $17::text, $18::jsonb, e.app, e.tenant, e.id FROM ended e
)
SELECT revision FROM ended;
