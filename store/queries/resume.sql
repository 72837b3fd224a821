-- resume_claim_agent_reply --
-- AdmitResume's claim, as ONE conditional statement: the agent_reply pause pinned to
-- (run, suspension, revision), unexpired by the database clock, moves the run to running with its
-- revision bumped (the admission's claimed_revision) and, when $6 is set, under a lease. Every claimer
-- contends on the run's row lock and re-checks state = 'paused' after the winner commits, so a loser
-- matches nothing. The pause row is read, not deleted: it is retained until the fleet removes it.
-- $1 run_id, $2 app, $3 tenant, $4 suspension_id, $5 pinned run_revision, $6 lease owner (NULL: no
-- lease), $7 lease ttl seconds
WITH claimed AS (
    UPDATE runs r
       SET state = 'running', revision = r.revision + 1, updated_at = now(),
           lease_owner = $6::text,
           lease_expires_at = CASE WHEN $6::text IS NULL THEN NULL
                                   ELSE now() + make_interval(secs => $7::float8) END
     WHERE r.id = $1 AND r.app = $2 AND r.tenant = $3 AND r.state = 'paused' AND r.revision = $5
       AND EXISTS (
           SELECT 1 FROM suspensions s
            WHERE s.id = $4 AND s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
              AND s.reason = 'agent_reply'
              AND (s.expires_at IS NULL OR s.expires_at > now()))
    RETURNING r.*
)
SELECT c.id AS r_id, c.app AS r_app, c.tenant AS r_tenant, c.agent_id AS r_agent_id, c.state AS r_state,
       c.revision AS r_revision, c.lease_owner AS r_lease_owner, c.lease_expires_at AS r_lease_expires_at,
       c.input AS r_input, c.output AS r_output, c.error AS r_error, c.session_id AS r_session_id,
       c.config AS r_config, c.script AS r_script, c.pause_ttl_seconds AS r_pause_ttl_seconds,
       c.step_count AS r_step_count, c.tokens_used AS r_tokens_used, c.created_at AS r_created_at,
       c.updated_at AS r_updated_at,
       s.id, s.run_id, s.app, s.tenant, s.reason, s.pending, s.continuation, s.checkpoint_id, s.approvers,
       s.expires_at, s.created_at
  FROM claimed c
  JOIN suspensions s ON s.id = $4 AND s.run_id = c.id;

-- resume_classify_claim --
-- Why an admission claim matched nothing: the run and its live pause as they stand now.
-- $1 run_id, $2 app, $3 tenant
SELECT r.state, r.revision, s.id AS suspension_id, s.reason, s.expires_at,
       (s.expires_at IS NOT NULL AND s.expires_at <= now()) AS expired
  FROM runs r
  LEFT JOIN suspensions s ON s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
 WHERE r.id = $1 AND r.app = $2 AND r.tenant = $3;

-- resume_insert_admission --
-- Record an admission, in the claiming transaction. $1 run_id, $2 suspension_id, $3 app, $4 tenant,
-- $5 schema_version, $6 pinned revision, $7 input, $8 request_digest, $9 suspension_digest,
-- $10 claimed_revision
INSERT INTO resume_admissions (run_id, suspension_id, app, tenant, schema_version, pinned_revision, input,
                               request_digest, suspension_digest, claimed_revision)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
RETURNING admitted_at;

-- resume_get_admission --
-- One admission at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT run_id, suspension_id, app, tenant, COALESCE(schema_version, 0) AS schema_version, pinned_revision,
       input, request_digest, suspension_digest, claimed_revision, admitted_at
  FROM resume_admissions
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_latest_admission --
-- A run's admission with the highest suspension id (the latest pause: ids come from one sequence), at
-- the exact scope. $1 run_id, $2 app, $3 tenant
SELECT run_id, suspension_id, app, tenant, COALESCE(schema_version, 0) AS schema_version, pinned_revision,
       input, request_digest, suspension_digest, claimed_revision, admitted_at
  FROM resume_admissions
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY suspension_id DESC
 LIMIT 1;

-- resume_list_admissions --
-- Exact-scope admission history in (run id, suspension id) order, strictly after the position
-- ($3, $4); a NULL $3 starts at the beginning. Run ids compare bytewise ("C"), so the order does not
-- depend on the database's collation. $1 app, $2 tenant, $3 after run_id, $4 after suspension_id,
-- $5 limit
SELECT run_id, suspension_id, app, tenant, COALESCE(schema_version, 0) AS schema_version, pinned_revision,
       input, request_digest, suspension_digest, claimed_revision, admitted_at
  FROM resume_admissions
 WHERE app = $1 AND tenant = $2
   AND ($3::text IS NULL
        OR run_id COLLATE "C" > $3::text COLLATE "C"
        OR (run_id = $3::text AND suspension_id > $4::bigint))
 ORDER BY run_id COLLATE "C", suspension_id
 LIMIT $5;

-- resume_lock_run --
-- Take the run's row lock for a start, an expiry or a closure, at the exact scope, and read the
-- database clock once for the transaction. Every run writer updates this row, so holding it FOR UPDATE
-- serialises these with all of them, and start with expiry. $1 run_id, $2 app, $3 tenant
SELECT id, app, tenant, agent_id, state, revision, lease_owner, lease_expires_at, input, output, error,
       session_id, config, script, pause_ttl_seconds, step_count, tokens_used, created_at, updated_at,
       now() AS db_now
  FROM runs
 WHERE id = $1 AND app = $2 AND tenant = $3
   FOR UPDATE;

-- resume_get_start --
-- One start at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT run_id, suspension_id, app, tenant, COALESCE(schema_version, 0) AS schema_version, pinned_revision,
       request_digest, started_at
  FROM resume_starts
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_insert_start --
-- Record the single grant of execution. $1 run_id, $2 suspension_id, $3 app, $4 tenant,
-- $5 schema_version, $6 pinned revision, $7 request_digest
INSERT INTO resume_starts (run_id, suspension_id, app, tenant, schema_version, pinned_revision,
                           request_digest)
VALUES ($1, $2, $3, $4, $5, $6, $7)
RETURNING started_at;

-- resume_get_pause --
-- The admitted pause itself, retained until the fleet deletes it. $1 run_id, $2 suspension_id, $3 app,
-- $4 tenant
SELECT id, run_id, app, tenant, reason, pending, continuation, checkpoint_id, approvers, expires_at,
       created_at
  FROM suspensions
 WHERE id = $2 AND run_id = $1 AND app = $3 AND tenant = $4;

-- resume_move_lease --
-- Hand a running run's lease to the starter, whoever held it; a lease is not a state, so the revision
-- does not change. $1 run_id, $2 app, $3 tenant, $4 owner, $5 ttl seconds
UPDATE runs
   SET lease_owner = $4, lease_expires_at = now() + make_interval(secs => $5::float8), updated_at = now()
 WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running'
RETURNING id, app, tenant, agent_id, state, revision, lease_owner, lease_expires_at, input, output, error,
          session_id, config, script, pause_ttl_seconds, step_count, tokens_used, created_at, updated_at;

-- resume_get_expiry --
-- One expiry at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT run_id, suspension_id, app, tenant, COALESCE(schema_version, 0) AS schema_version, pinned_revision,
       request_digest, event_id, run_revision, expired_at
  FROM resume_expiries
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_insert_expiry --
-- Record an expiry and its run_events row in ONE statement, so neither commits without the other.
-- $1 run_id, $2 suspension_id, $3 app, $4 tenant, $5 schema_version, $6 pinned revision,
-- $7 request_digest, $8 event_id, $9 run_revision, $10 event data
WITH expiry AS (
    INSERT INTO resume_expiries (run_id, suspension_id, app, tenant, schema_version, pinned_revision,
                                 request_digest, event_id, run_revision)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
    RETURNING expired_at
), event AS (
    INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
    VALUES ($8, $1, $3, $4, 'resume_expired', $9, $10::jsonb)
)
SELECT expired_at FROM expiry;

-- resume_get_closure --
-- One closure at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT run_id, suspension_id, app, tenant, COALESCE(schema_version, 0) AS schema_version, request,
       request_digest, event_id, run_revision, closed_at
  FROM resume_closures
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_close_run --
-- End a running run as incomplete: there is no 'incomplete' state, so it fails with an error that says
-- so; revision + 1, lease cleared, no output. Guarded on the revision the closure bound, under the row
-- lock the caller already holds. $1 run_id, $2 app, $3 tenant, $4 bound revision, $5 error
UPDATE runs
   SET state = 'failed', revision = revision + 1, lease_owner = NULL, lease_expires_at = NULL,
       error = $5, updated_at = now(), ended_at = now()
 WHERE id = $1 AND app = $2 AND tenant = $3 AND state = 'running' AND revision = $4
RETURNING revision;

-- resume_insert_closure --
-- Record a closure receipt and its run_events row in ONE statement. $1 run_id, $2 suspension_id, $3 app,
-- $4 tenant, $5 schema_version, $6 request, $7 request_digest, $8 event_id, $9 run_revision,
-- $10 event data
WITH closure AS (
    INSERT INTO resume_closures (run_id, suspension_id, app, tenant, schema_version, request,
                                 request_digest, event_id, run_revision)
    VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8, $9)
    RETURNING closed_at
), event AS (
    INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
    VALUES ($8, $1, $3, $4, 'resume_closed', $9, $10::jsonb)
)
SELECT closed_at FROM closure;

-- resume_drop_run_leftovers --
-- What a terminal run no longer has: its progress snapshot and its live pause, removed in the closing
-- transaction as every other end removes them. $1 run_id
WITH progress_gone AS (
    DELETE FROM progress WHERE run_id = $1
)
DELETE FROM suspensions WHERE run_id = $1;

-- resume_list_agent_reply_runs --
-- ReplyDiscoveryStore: run ids at the exact scope that hold a retained agent_reply pause (expired and
-- already admitted ones included) or whose latest admission still holds the run (running at the
-- revision the claim produced, so a start changes nothing and the pause row may be gone), ascending
-- bytewise strictly after $3. $1 app, $2 tenant, $3 after run_id ('' starts at the beginning), $4 limit
SELECT run_id FROM (
    SELECT s.run_id
      FROM suspensions s
     WHERE s.app = $1 AND s.tenant = $2 AND s.reason = 'agent_reply'
    UNION
    SELECT a.run_id
      FROM resume_admissions a
      JOIN runs r ON r.id = a.run_id AND r.app = a.app AND r.tenant = a.tenant
     WHERE a.app = $1 AND a.tenant = $2 AND r.state = 'running' AND r.revision = a.claimed_revision
) found
 WHERE run_id COLLATE "C" > $3::text COLLATE "C"
 ORDER BY run_id COLLATE "C"
 LIMIT $4;
