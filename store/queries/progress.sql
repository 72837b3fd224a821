-- get_progress --
-- Read a run's snapshot at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT run_id, app, tenant, owner, continuation, started, done, ending, approved, updated_at
  FROM progress
 WHERE run_id = $1 AND app = $2 AND tenant = $3;
