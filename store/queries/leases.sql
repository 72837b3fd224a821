-- renew_leases --
-- One worker's lease renewal of every run it holds, in ONE statement per tick, by the database clock: each
-- run is named by its id AND its exact scope (three parallel arrays; a run id is unique only within its
-- scope), so this crosses scopes only as far as one worker's own runs do, and matches nothing of anybody
-- else's. Rows are locked in key order, so two statements that lock several runs never wait on each other in
-- a cycle. One row per run still held by $1: its key and the end asked of it while it ran (NULL when none);
-- a run not returned is no longer held.
-- $1 owner, $2 ttl seconds, $3 run ids (text[]), $4 apps (text[]), $5 tenants (text[])
WITH held AS (
    SELECT r.app, r.tenant, r.id
      FROM runs r
      JOIN unnest($3::text[], $4::text[], $5::text[]) AS h (id, app, tenant)
        ON r.id = h.id AND r.app = h.app AND r.tenant = h.tenant
     WHERE r.state = 'running' AND $1::text <> '' AND r.lease_owner = $1::text AND r.lease_expires_at > now()
     ORDER BY r.app, r.tenant, r.id
       FOR NO KEY UPDATE OF r
)
UPDATE runs r
   SET lease_expires_at = now() + make_interval(secs => $2::float8)
  FROM held
 WHERE r.app = held.app AND r.tenant = held.tenant AND r.id = held.id
   AND r.state = 'running' AND r.lease_owner = $1::text AND r.lease_expires_at > now()
RETURNING r.id, r.app, r.tenant, r.ending;
