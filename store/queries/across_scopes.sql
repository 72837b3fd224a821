-- Every statement in this file reads ACROSS SCOPES, for process infrastructure that has no request scope
-- (the expiry sweeper, the reclaim sweep, the outbox relay, operators). Callers act on each row found only
-- under that row's own scope.

-- list_expired_across_scopes --
-- The original's ListExpiredAcrossScopes: expired pauses of every scope. $1 now, $2 limit (NULL: no limit)
SELECT *
  FROM suspensions
 WHERE expires_at IS NOT NULL AND expires_at <= LEAST($1::timestamptz, now())
 ORDER BY expires_at, id
 LIMIT $2;

-- database_now --
-- The database clock, which judges every deadline; one reading bounds one sweep. No parameters
SELECT now();

-- list_expired_paused_across_scopes --
-- The expiry sweeper's page: pauses of PAUSED runs in every scope whose deadline passed at or before $1
-- (and the database clock), each with its run's revision, in (expires_at, id) order strictly after the
-- keyset cursor ($2, $3), at most $4. $1 cutoff, $2 cursor expires_at (the minimum timestamp for the first
-- page), $3 cursor suspension id, $4 limit
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

-- claim_unsent_outbox --
-- The relay's batch: up to $1 unsent outbox rows, oldest first, locked for the caller's transaction.
-- SKIP LOCKED passes over rows another relay holds, so two relays never publish the same row at the same
-- time and neither waits for the other. $1 limit
SELECT id, message_id, routing_key, body, correlation_id, headers
  FROM outbox
 WHERE sent_at IS NULL
 ORDER BY id
 LIMIT $1
   FOR UPDATE SKIP LOCKED;

-- mark_outbox_sent --
-- Rows whose publisher confirm arrived, marked in the transaction that claimed them, by the database
-- clock. $1 outbox ids (bigint[])
UPDATE outbox
   SET sent_at = now()
 WHERE id = ANY($1::bigint[]) AND sent_at IS NULL;

-- count_unsent_outbox --
-- How many outbox rows wait for the relay (drain checks, metrics). No parameters
SELECT count(*) FROM outbox WHERE sent_at IS NULL;

-- count_running --
-- How many runs are running, and how many of those hold a live lease. No parameters.
SELECT count(*) AS running,
       count(*) FILTER (WHERE lease_expires_at > now()) AS leased
  FROM runs
 WHERE state = 'running';

-- list_runs --
-- The latest runs, newest first, optionally in one state. $1 state (NULL: any), $2 limit
SELECT *
  FROM runs
 WHERE $1::run_state IS NULL OR state = $1::run_state
 ORDER BY updated_at DESC, id
 LIMIT $2;
