-- get_suspension --
-- Read a run's live pause at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT * FROM suspensions WHERE run_id = $1 AND app = $2 AND tenant = $3;

-- list_expired --
-- Pauses at the exact scope whose deadline is at or before $3 (and the database clock), soonest first.
-- $1 app, $2 tenant, $3 now, $4 limit (NULL: no limit)
SELECT *
  FROM suspensions
 WHERE app = $1 AND tenant = $2
   AND expires_at IS NOT NULL AND expires_at <= LEAST($3::timestamptz, now())
 ORDER BY expires_at, id
 LIMIT $4;
