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

-- resume_get_start --
-- One start at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT * FROM resume_starts
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_get_expiry --
-- One expiry at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT * FROM resume_expiries
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

-- resume_get_closure --
-- One closure at the exact scope. $1 run_id, $2 suspension_id, $3 app, $4 tenant
SELECT * FROM resume_closures
 WHERE run_id = $1 AND suspension_id = $2 AND app = $3 AND tenant = $4;

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
