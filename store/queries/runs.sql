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

-- list_run_events --
-- A run's metadata events in order, at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT event_id, kind, revision, data, created_at
  FROM run_events
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY id;
