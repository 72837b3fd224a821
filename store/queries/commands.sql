-- decide_checkpoint --
-- Record an approval decision on a pending checkpoint, in the claiming transaction.
-- $1 checkpoint_id, $2 run_id, $3 state, $4 decided_by, $5 reason
UPDATE checkpoints
   SET state = $3, decided_by = $4, reason = $5, decided_at = now()
 WHERE id = $1 AND run_id = $2 AND state = 'pending'
RETURNING id;

-- run_state --
-- A run's state at the exact scope. $1 id, $2 app, $3 tenant
SELECT state FROM runs WHERE id = $1 AND app = $2 AND tenant = $3;

-- load_session --
-- A session's messages in order, at the exact scope. $1 app, $2 tenant, $3 session_id
SELECT message FROM session_messages WHERE app = $1 AND tenant = $2 AND session_id = $3 ORDER BY id;

-- append_session --
-- Append a run's own messages to its session. $1 app, $2 tenant, $3 session_id, $4 run_id, $5 messages
INSERT INTO session_messages (app, tenant, session_id, run_id, message)
SELECT $1, $2, $3, $4, m FROM jsonb_array_elements($5::jsonb) WITH ORDINALITY AS t (m, n) ORDER BY n;

-- read_pause_and_run --
-- A run's live pause at the exact scope together with its run row (run columns prefixed r_), read before a
-- resume's one-statement claim so that both are decoded and checked before anything is written.
-- $1 run_id, $2 app, $3 tenant
SELECT s.id, s.run_id, s.app, s.tenant, s.reason, s.pending, s.continuation, s.checkpoint_id, s.approvers,
       s.expires_at, s.created_at,
       r.id AS r_id, r.app AS r_app, r.tenant AS r_tenant, r.agent_id AS r_agent_id, r.state AS r_state,
       r.revision AS r_revision, r.lease_owner AS r_lease_owner, r.lease_expires_at AS r_lease_expires_at,
       r.input AS r_input, r.output AS r_output, r.error AS r_error, r.session_id AS r_session_id,
       r.config AS r_config, r.script AS r_script, r.pause_ttl_seconds AS r_pause_ttl_seconds,
       r.step_count AS r_step_count, r.tokens_used AS r_tokens_used, r.created_at AS r_created_at,
       r.updated_at AS r_updated_at
  FROM suspensions s
  JOIN runs r ON r.id = s.run_id AND r.app = s.app AND r.tenant = s.tenant
 WHERE s.run_id = $1 AND s.app = $2 AND s.tenant = $3;

-- claim_resume --
-- A host's resume as ONE statement, which is its own transaction: the pinned leased claim (exactly the
-- conditions of claim_suspension_leased for an unexpired pause), the first progress snapshot (the claimed
-- pause's continuation as stored, the answers in $8), the removal of the answered pause, the inbox record
-- (when $9 is set) and the run.resumed event. Every write hangs off the claim, so a claim that matches
-- nothing writes nothing and returns no row. The inbox insert has no ON CONFLICT on purpose: a message_id
-- recorded before, or being recorded by a concurrent transaction, fails the whole statement with a unique
-- violation and nothing is written; the caller then takes the step-by-step path, which says why.
-- Nothing read here needs decoding: the caller decoded the pause and the run (read_pause_and_run) at the
-- revision this claim pins, and a run row does not change without its revision changing.
-- $1 run_id, $2 app, $3 tenant, $4 suspension_id, $5 run_revision, $6 lease owner, $7 lease ttl seconds,
-- $8 first done, $9 inbox message_id (NULL: no inbox record), $10 inbox routing_key, $11 inbox body_digest,
-- $12 outbox message_id, $13 outbox routing_key, $14 outbox body, $15 outbox correlation_id,
-- $16 outbox headers
WITH claimed AS (
    UPDATE runs r
       SET state = 'running', revision = r.revision + 1, updated_at = now(),
           lease_owner = $6::text, lease_expires_at = now() + make_interval(secs => $7::float8)
     WHERE r.id = $1 AND r.app = $2 AND r.tenant = $3 AND r.state = 'paused' AND r.revision = $5
       AND EXISTS (
           SELECT 1 FROM suspensions s
            WHERE s.id = $4 AND s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
              AND (s.expires_at IS NULL OR s.expires_at > now()))
    RETURNING r.id, r.app, r.tenant, r.state, r.revision, r.lease_owner, r.lease_expires_at, r.updated_at
), first AS (
    INSERT INTO progress AS p (run_id, app, tenant, owner, continuation, started, done, ending, approved,
                               updated_at)
    SELECT c.id, c.app, c.tenant, $6::text, s.continuation, '[]'::jsonb, $8::jsonb, NULL, '[]'::jsonb, now()
      FROM claimed c
      JOIN suspensions s ON s.id = $4 AND s.run_id = c.id
    ON CONFLICT (run_id) DO UPDATE
       SET app = excluded.app, tenant = excluded.tenant, owner = excluded.owner,
           continuation = excluded.continuation, started = excluded.started, done = excluded.done,
           ending = excluded.ending, approved = excluded.approved, updated_at = excluded.updated_at
    RETURNING p.updated_at
), answered AS (
    DELETE FROM suspensions s USING claimed c WHERE s.run_id = c.id
), recorded AS (
    INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)
    SELECT $9::text, $10::text, $11::text, 'applied', c.app, c.tenant, c.id
      FROM claimed c
     WHERE $9::text IS NOT NULL
), announced AS (
    INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
    SELECT $12::uuid, $13::text, $14::text, $15::text, $16::jsonb, c.app, c.tenant, c.id
      FROM claimed c
)
SELECT c.state, c.revision, c.lease_owner, c.lease_expires_at, c.updated_at,
       (SELECT f.updated_at FROM first f) AS first_updated_at
  FROM claimed c;
