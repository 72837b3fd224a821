-- save_progress --
-- Upsert a run's snapshot, only while the run is running under $4's live lease. The run row is locked
-- FOR SHARE, so a takeover that commits first is seen (the re-check finds another owner) and a takeover
-- that comes second waits for this write. An empty owner never matches.
-- $1 run_id, $2 app, $3 tenant, $4 owner, $5 continuation, $6 started, $7 done, $8 ending, $9 approved
WITH holder AS (
    SELECT r.id, r.app, r.tenant
      FROM runs r
     WHERE r.id = $1 AND r.app = $2 AND r.tenant = $3 AND r.state = 'running'
       AND $4::text <> '' AND r.lease_owner = $4 AND r.lease_expires_at > now()
       FOR SHARE
)
INSERT INTO progress AS p (run_id, app, tenant, owner, continuation, started, done, ending, approved, updated_at)
SELECT h.id, h.app, h.tenant, $4, $5::jsonb, $6::jsonb, $7::jsonb, $8::jsonb, $9::jsonb, now()
  FROM holder h
ON CONFLICT (run_id) DO UPDATE
   SET owner = excluded.owner, continuation = excluded.continuation, started = excluded.started,
       done = excluded.done, ending = excluded.ending, approved = excluded.approved,
       updated_at = excluded.updated_at
RETURNING p.updated_at;

-- get_progress --
-- Read a run's snapshot at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT run_id, app, tenant, owner, continuation, started, done, ending, approved, updated_at
  FROM progress
 WHERE run_id = $1 AND app = $2 AND tenant = $3;

-- delete_progress --
-- Remove a run's snapshot at the exact scope. $1 run_id, $2 app, $3 tenant
DELETE FROM progress WHERE run_id = $1 AND app = $2 AND tenant = $3;

-- delete_run_progress --
-- Remove a run's snapshot, inside a transaction that already holds the run. $1 run_id
DELETE FROM progress WHERE run_id = $1;

-- adopt_progress --
-- Hand runs' snapshots to their new lease owner, inside the takeover's transaction. $1 run ids, $2 owner
UPDATE progress SET owner = $2, updated_at = now() WHERE run_id = ANY($1::text[])
RETURNING run_id, app, tenant, owner, continuation, started, done, ending, approved, updated_at;
