-- admit_resume --
-- An agent reply's admission (intermission_admit_resume_v1), with the delivering command's inbox record
-- when message_id is set. One row: the outcome, the admission as recorded now or before (a composite), and
-- for a refusal the run's revision and its pause as they stand.
-- writes: outbox, inbox
SELECT a.outcome, a.admission, a.revision AS r_revision, a.suspension_id AS s_id, a.expires_at AS s_expires_at
  FROM intermission_admit_resume_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_suspension_id => $4, p_revision => $5,
    p_lease_owner => $6, p_lease_ttl => $7, p_first_continuation => $8, p_first_done => $9,
    p_schema_version => $10, p_input => $11, p_request_digest => $12, p_suspension_digest => $13,
    p_message_id => $14, p_routing_key => $15, p_digest => $16,
    p_event_message_id => $17, p_event_routing_key => $18, p_event_body => $19,
    p_event_correlation_id => $20, p_event_headers => $21) AS a;

-- start_resume --
-- The single grant of execution (intermission_start_resume_v1). One row: the outcome, the start, the
-- expiry's time, and on a fresh start the run and the pause to execute (composites).
SELECT g.outcome, g.start, g.expired_at, g.run, g.pause
  FROM intermission_start_resume_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_suspension_id => $4, p_digest => $5,
    p_lease_owner => $6, p_lease_ttl => $7, p_first_continuation => $8, p_first_done => $9,
    p_schema_version => $10) AS g;

-- resume_get_admission --
-- One admission at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT * FROM resume_admissions
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_latest_admission --
-- A run's admission with the highest suspension id (the latest pause: ids come from one sequence), at
-- the exact scope. $1 run_id, $2 app, $3 tenant
SELECT * FROM resume_admissions
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY suspension_id DESC
 LIMIT 1;

-- resume_list_admissions --
-- Exact-scope admission history in (run id, suspension id) order, strictly after the position
-- ($3, $4); a NULL $3 starts at the beginning. Run ids compare bytewise ("C"), so the order does not
-- depend on the database's collation. $1 app, $2 tenant, $3 after run_id, $4 after suspension_id,
-- $5 limit
SELECT * FROM resume_admissions
 WHERE app = $1 AND tenant = $2
   AND ($3::text IS NULL
        OR run_id COLLATE "C" > $3::text COLLATE "C"
        OR (run_id = $3::text AND suspension_id > $4::bigint))
 ORDER BY run_id COLLATE "C", suspension_id
 LIMIT $5;

-- resume_lock_run --
-- Take the run's row lock for an expiry or a closure, at the exact scope, and read the database clock
-- once for the transaction. Every run writer updates this row, so holding it FOR UPDATE serialises these
-- with all of them, and with a start. $1 run_id, $2 app, $3 tenant
SELECT id, app, tenant, state, revision, now() AS db_now
  FROM runs
 WHERE id = $1 AND app = $2 AND tenant = $3
   FOR UPDATE;

-- resume_get_start --
-- One start at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT * FROM resume_starts
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_get_expiry --
-- One expiry at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT * FROM resume_expiries
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
SELECT * FROM resume_closures
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_insert_closure --
-- Record a closure receipt, in the transaction whose end of the run wrote its run_events row.
-- $1 run_id, $2 suspension_id, $3 app, $4 tenant, $5 schema_version, $6 request, $7 request_digest,
-- $8 event_id, $9 run_revision
INSERT INTO resume_closures (run_id, suspension_id, app, tenant, schema_version, request, request_digest,
                             event_id, run_revision)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8, $9)
RETURNING closed_at;

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

-- list_run_admissions --
-- Operators (`intermission runs show`): a run's agent-reply admissions at the exact scope, each with when it
-- was started, expired or closed (NULL: not). $1 run_id, $2 app, $3 tenant
SELECT a.suspension_id, a.pinned_revision, a.claimed_revision, a.admitted_at, st.started_at, ex.expired_at,
       cl.closed_at
  FROM resume_admissions a
  LEFT JOIN resume_starts st
         ON st.app = a.app AND st.tenant = a.tenant AND st.run_id = a.run_id AND st.suspension_id = a.suspension_id
  LEFT JOIN resume_expiries ex
         ON ex.app = a.app AND ex.tenant = a.tenant AND ex.run_id = a.run_id AND ex.suspension_id = a.suspension_id
  LEFT JOIN resume_closures cl
         ON cl.app = a.app AND cl.tenant = a.tenant AND cl.run_id = a.run_id AND cl.suspension_id = a.suspension_id
 WHERE a.run_id = $1 AND a.app = $2 AND a.tenant = $3
 ORDER BY a.suspension_id;
