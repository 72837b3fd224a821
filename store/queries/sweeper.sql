-- sweeper_database_now --
-- The database clock, which judges every deadline; one reading bounds one sweep. No parameters
SELECT now();

-- list_expired_paused_across_scopes --
-- CROSS-SCOPE, for the expiry sweeper only: pauses of PAUSED runs in EVERY scope whose deadline passed at
-- or before $1 (and the database clock), each with its run's revision, in (expires_at, id) order strictly
-- after the keyset cursor ($2, $3), at most $4. Callers must act on each row under that row's own scope.
-- $1 cutoff, $2 cursor expires_at (the minimum timestamp for the first page), $3 cursor suspension id,
-- $4 limit
SELECT s.id AS suspension_id, s.run_id, s.app, s.tenant, s.expires_at, r.revision AS run_revision
  FROM suspensions s
  JOIN runs r ON r.id = s.run_id AND r.app = s.app AND r.tenant = s.tenant
 WHERE s.expires_at IS NOT NULL
   AND s.expires_at <= LEAST($1::timestamptz, now())
   AND s.expires_at >= $2::timestamptz
   AND (s.expires_at, s.id) > ($2::timestamptz, $3::bigint)
   AND r.state = 'paused'
 ORDER BY s.expires_at, s.id
 LIMIT $4;
