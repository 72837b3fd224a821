-- create_suspension --
-- Insert a live pause for a run that exists at the exact scope. The deadline is the database clock plus
-- a ttl when $8 is set, else $7 as given.
-- $1 run_id, $2 app, $3 tenant, $4 reason, $5 pending, $6 continuation, $7 expires_at, $8 ttl seconds,
-- $9 checkpoint_id, $10 approvers
INSERT INTO suspensions (run_id, app, tenant, reason, pending, continuation, expires_at, checkpoint_id, approvers)
SELECT r.id, r.app, r.tenant, $4::suspend_reason, $5::jsonb, $6::jsonb,
       CASE WHEN $8::float8 IS NULL THEN $7::timestamptz ELSE now() + make_interval(secs => $8::float8) END,
       $9::bigint, $10::text[]
  FROM runs r
 WHERE r.id = $1 AND r.app = $2 AND r.tenant = $3
RETURNING id, expires_at, created_at;

-- get_suspension --
-- Read a run's live pause at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT id, run_id, app, tenant, reason, pending, continuation, checkpoint_id, approvers, expires_at, created_at
  FROM suspensions
 WHERE run_id = $1 AND app = $2 AND tenant = $3;

-- delete_suspension --
-- Remove a run's pause at the exact scope. $1 run_id, $2 app, $3 tenant
DELETE FROM suspensions WHERE run_id = $1 AND app = $2 AND tenant = $3 RETURNING id;

-- list_expired --
-- Pauses at the exact scope whose deadline is at or before $3 (and the database clock), soonest first.
-- $1 app, $2 tenant, $3 now, $4 limit (NULL: no limit)
SELECT id, run_id, app, tenant, reason, pending, continuation, checkpoint_id, approvers, expires_at, created_at
  FROM suspensions
 WHERE app = $1 AND tenant = $2
   AND expires_at IS NOT NULL AND expires_at <= LEAST($3::timestamptz, now())
 ORDER BY expires_at, id
 LIMIT $4;

-- list_expired_across_scopes --
-- THE cross-scope read: expired pauses of every scope, for the expiry sweeper only. Callers must act on
-- each row under that row's own scope. $1 now, $2 limit (NULL: no limit)
SELECT id, run_id, app, tenant, reason, pending, continuation, checkpoint_id, approvers, expires_at, created_at
  FROM suspensions
 WHERE expires_at IS NOT NULL AND expires_at <= LEAST($1::timestamptz, now())
 ORDER BY expires_at, id
 LIMIT $2;

-- claim_suspension --
-- The atomic paused -> running move, conditioned in ONE statement on a live pause at the exact scope:
-- unpinned, unleased (the seed's ClaimSuspension), or, with $4 set, only a pause expired by $4 and by the
-- database clock (ClaimExpiredSuspension). Every claimer of a run contends on its row lock; the loser
-- re-checks state = 'paused' after the winner commits and matches nothing. The re-check also pins the
-- revision this statement's snapshot read (an InitPlan, evaluated once): a claimer that waited while the
-- run was claimed AND paused again finds 'paused' once more, but its suspension check and the row it would
-- return are the OLD pause's, so it must not claim the new one (tests: test_unpinned_claim_waiting_...).
-- $1 run_id, $2 app, $3 tenant, $4 expired_by (NULL: only an unexpired pause)
WITH claimed AS (
    UPDATE runs r
       SET state = 'running', revision = r.revision + 1, updated_at = now()
     WHERE r.id = $1 AND r.app = $2 AND r.tenant = $3 AND r.state = 'paused'
       AND r.revision = (SELECT r0.revision FROM runs r0 WHERE r0.id = $1 AND r0.app = $2 AND r0.tenant = $3)
       AND EXISTS (
           SELECT 1 FROM suspensions s
            WHERE s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
              AND CASE WHEN $4::timestamptz IS NULL
                       THEN s.expires_at IS NULL OR s.expires_at > now()
                       ELSE s.expires_at IS NOT NULL AND s.expires_at <= LEAST($4::timestamptz, now())
                  END)
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
  JOIN suspensions s ON s.run_id = c.id;

-- claim_suspension_leased --
-- ClaimSuspensionVersion and ClaimSuspensionLeased as ONE statement: the pause pinned to
-- (run, suspension, revision), the move to running with the revision bumped, the lease (its expiry by
-- the database clock) and, when $9 is set, the first progress snapshot.
-- $1 run_id, $2 app, $3 tenant, $4 suspension_id, $5 run_revision, $6 lease owner (NULL: no lease),
-- $7 lease ttl seconds, $8 expired_by (NULL: only an unexpired pause), $9 first continuation (NULL: no
-- snapshot), $10 first started, $11 first done, $12 first ending, $13 first approved
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
              AND CASE WHEN $8::timestamptz IS NULL
                       THEN s.expires_at IS NULL OR s.expires_at > now()
                       ELSE s.expires_at IS NOT NULL AND s.expires_at <= LEAST($8::timestamptz, now())
                  END)
    RETURNING r.*
), first AS (
    INSERT INTO progress AS p (run_id, app, tenant, owner, continuation, started, done, ending, approved,
                               updated_at)
    SELECT c.id, c.app, c.tenant, $6::text, $9::jsonb, $10::jsonb, $11::jsonb, $12::jsonb, $13::jsonb, now()
      FROM claimed c
     WHERE $9::jsonb IS NOT NULL
    ON CONFLICT (run_id) DO UPDATE
       SET app = excluded.app, tenant = excluded.tenant, owner = excluded.owner,
           continuation = excluded.continuation, started = excluded.started, done = excluded.done,
           ending = excluded.ending, approved = excluded.approved, updated_at = excluded.updated_at
    RETURNING p.updated_at
)
SELECT c.id AS r_id, c.app AS r_app, c.tenant AS r_tenant, c.agent_id AS r_agent_id, c.state AS r_state,
       c.revision AS r_revision, c.lease_owner AS r_lease_owner, c.lease_expires_at AS r_lease_expires_at,
       c.input AS r_input, c.output AS r_output, c.error AS r_error, c.session_id AS r_session_id,
       c.config AS r_config, c.script AS r_script, c.pause_ttl_seconds AS r_pause_ttl_seconds,
       c.step_count AS r_step_count, c.tokens_used AS r_tokens_used, c.created_at AS r_created_at,
       c.updated_at AS r_updated_at,
       s.id, s.run_id, s.app, s.tenant, s.reason, s.pending, s.continuation, s.checkpoint_id, s.approvers,
       s.expires_at, s.created_at,
       (SELECT f.updated_at FROM first f) AS first_updated_at
  FROM claimed c
  JOIN suspensions s ON s.run_id = c.id;

-- classify_claim_failure --
-- Why a claim matched nothing: the run and its pause as they stand. $1 run_id, $2 app, $3 tenant
SELECT r.state, r.revision, s.id AS suspension_id, s.expires_at,
       (s.expires_at IS NOT NULL AND s.expires_at <= now()) AS expired
  FROM runs r
  LEFT JOIN suspensions s ON s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
 WHERE r.id = $1 AND r.app = $2 AND r.tenant = $3;
