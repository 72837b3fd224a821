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
-- time and neither waits for the other. A quarantined row is passed over (the partial index leaves it out),
-- and so is a refused row until its next attempt is due, so the rows behind them go out. $1 limit
SELECT id, message_id, routing_key, body, correlation_id, headers
  FROM outbox
 WHERE sent_at IS NULL AND quarantined_at IS NULL
   AND (next_attempt_at IS NULL OR next_attempt_at <= now())
 ORDER BY id
 LIMIT $1
   FOR UPDATE SKIP LOCKED;

-- mark_outbox_sent --
-- Rows whose publisher confirm arrived, marked in the transaction that claimed them, by the database
-- clock, each by its own key probe (intermission_mark_sent_v1, migration 0013). $1 outbox ids (bigint[])
SELECT intermission_mark_sent_v1($1::bigint[]) AS marked;

-- mark_handed_outbox_sent --
-- Rows whose writer published them from memory (handed over, migration 0009) and got the publisher confirm:
-- marked sent by the database clock, their hold cleared, each by its own key probe
-- (intermission_mark_handed_sent_v1, migration 0013). A row a relay published meanwhile (its hold passed)
-- is sent already and stays as it is. $1 message ids (uuid[])
SELECT intermission_mark_handed_sent_v1($1::uuid[]) AS marked;

-- refuse_outbox --
-- Rows the broker refused, in the transaction that claimed them: one more attempt each, with the broker's
-- reason. A row refused $3 times is quarantined: no claim takes it until an operator retries it. Any other
-- waits before its next attempt, $4 seconds doubled per earlier refusal and at most $5, so that a queue that
-- is full for a moment gets that moment, and retrying it never holds up the rows behind it. The exponent is
-- bounded so that no setting of $3 overflows it. $1 outbox ids (bigint[]), $2 reasons (text[], in the same
-- order), $3 max attempts, $4 first wait in seconds, $5 longest wait in seconds
UPDATE outbox o
   SET attempts = o.attempts + 1,
       last_error = r.reason,
       quarantined_at = CASE WHEN o.attempts + 1 >= $3::int THEN now() END,
       next_attempt_at = CASE
           WHEN o.attempts + 1 < $3::int
           THEN now() + make_interval(secs => least($4::float8 * 2 ^ least(o.attempts, 30), $5::float8))
       END
  FROM unnest($1::bigint[], $2::text[]) AS r(id, reason)
 WHERE o.id = r.id AND o.sent_at IS NULL AND o.quarantined_at IS NULL
RETURNING o.id, o.message_id::text AS message_id, o.routing_key, o.attempts, o.last_error,
          o.quarantined_at IS NOT NULL AS quarantined,
          extract(epoch FROM o.next_attempt_at - now())::float8 AS retry_in;

-- count_unsent_outbox --
-- How many outbox rows wait for the relay, due or not (drain checks, metrics); quarantined rows wait for an
-- operator instead. No parameters
SELECT count(*) FROM outbox WHERE sent_at IS NULL AND quarantined_at IS NULL;

-- count_quarantined_outbox --
-- How many outbox rows are quarantined (the metrics' gauge). No parameters
SELECT count(*) FROM outbox WHERE quarantined_at IS NOT NULL;

-- list_unsent_outbox --
-- Operators: the rows the relay still tries, oldest first, with the refusals each has had so far. $1 limit
SELECT id, message_id::text AS message_id, routing_key, app, tenant, run_id, created_at, attempts,
       next_attempt_at, quarantined_at, last_error
  FROM outbox
 WHERE sent_at IS NULL AND quarantined_at IS NULL
 ORDER BY id
 LIMIT $1;

-- list_quarantined_outbox --
-- Operators: the quarantined rows, oldest first, with why the broker refused them. $1 limit
SELECT id, message_id::text AS message_id, routing_key, app, tenant, run_id, created_at, attempts,
       next_attempt_at, quarantined_at, last_error
  FROM outbox
 WHERE quarantined_at IS NOT NULL
 ORDER BY id
 LIMIT $1;

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

-- server_address --
-- Which server a new pooled connection landed on, for the log line that says when the pool moved to another
-- host (a multi-host DSN after a failover). NULL address: a Unix socket. No parameters
SELECT host(inet_server_addr()) AS address, inet_server_port() AS port;

-- find_run_scopes --
-- Operators: the scopes a run id is found in (a run id is unique only within its scope), so that
-- `intermission runs show RUN` needs no --app/--tenant when the id names one run. No index leads with the
-- id alone (migration 0015: the planner would take one for the key), so this walks the key scope by scope:
-- each next scope found by one probe of the key past the last (a loose index scan), then the id probed in
-- it. It costs two probes per scope that has runs, never a pass over the runs. $1 run id
WITH RECURSIVE scopes AS (
    (SELECT r.app, r.tenant FROM runs r ORDER BY r.app, r.tenant LIMIT 1)
    UNION ALL
    SELECT n.app, n.tenant
      FROM scopes s
     CROSS JOIN LATERAL (
         SELECT r.app, r.tenant FROM runs r
          WHERE (r.app, r.tenant) > (s.app, s.tenant)
          ORDER BY r.app, r.tenant
          LIMIT 1) n
)
SELECT s.app, s.tenant
  FROM scopes s
 WHERE EXISTS (SELECT 1 FROM runs r WHERE r.app = s.app AND r.tenant = s.tenant AND r.id = $1)
 ORDER BY s.app, s.tenant;

-- list_run_summaries --
-- Operators (`intermission runs list`): runs newest change first, each with its live pause's reason and
-- deadline (a paused run's), filtered by whichever of these is not NULL, after the keyset cursor ($8 ..
-- $11) in that order: the last change, then the run's key (id, app, tenant), so that runs of one id in two
-- scopes changed at the same moment are both listed. $1 app, $2 tenant, $3 state, $4 the live pause's
-- reason, $5 unchanged for at least so many seconds, $6 a live pause's deadline within so many seconds
-- from now (passed ones included), $7 limit, $8 cursor updated_at, $9 cursor id, $10 cursor app,
-- $11 cursor tenant
SELECT r.id, r.app, r.tenant, r.agent_id, r.state::text AS state, r.revision, r.lease_owner,
       r.lease_expires_at, r.step_count, r.created_at, r.updated_at, r.ended_at,
       s.id AS suspension_id, s.reason::text AS reason, s.expires_at
  FROM runs r
  LEFT JOIN suspensions s ON s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant AND r.state = 'paused'
 WHERE ($1::text IS NULL OR r.app = $1::text)
   AND ($2::text IS NULL OR r.tenant = $2::text)
   AND ($3::run_state IS NULL OR r.state = $3::run_state)
   AND ($4::suspend_reason IS NULL OR s.reason = $4::suspend_reason)
   AND ($5::float8 IS NULL OR r.updated_at <= now() - make_interval(secs => $5::float8))
   AND ($6::float8 IS NULL OR s.expires_at <= now() + make_interval(secs => $6::float8))
   AND ($8::timestamptz IS NULL
        OR (r.updated_at, r.id, r.app, r.tenant) < ($8::timestamptz, $9::text, $10::text, $11::text))
 ORDER BY r.updated_at DESC, r.id DESC, r.app DESC, r.tenant DESC
 LIMIT $7;

-- open_pauses --
-- The metrics and doctor: live pauses of paused runs, by reason and by how long they have been open (a
-- bounded set of age buckets). No parameters
SELECT s.reason::text AS reason,
       CASE WHEN s.created_at > now() - interval '1 minute' THEN 'under_1m'
            WHEN s.created_at > now() - interval '1 hour' THEN '1m_to_1h'
            WHEN s.created_at > now() - interval '1 day' THEN '1h_to_1d'
            WHEN s.created_at > now() - interval '7 days' THEN '1d_to_7d'
            ELSE 'over_7d' END AS age,
       count(*) AS pauses
  FROM suspensions s
  JOIN runs r ON r.id = s.run_id AND r.app = s.app AND r.tenant = s.tenant AND r.state = 'paused'
 GROUP BY 1, 2;

-- pause_deadlines --
-- The metrics and doctor: the earliest deadline of a live pause, and the earliest one that has passed while
-- its run is still paused (what the sweepers have yet to expire), with how many have, by the database
-- clock. No parameters
SELECT min(s.expires_at) AS earliest,
       min(s.expires_at) FILTER (WHERE s.expires_at <= now()) AS earliest_passed,
       count(*) FILTER (WHERE s.expires_at <= now()) AS passed,
       now() AS now
  FROM suspensions s
  JOIN runs r ON r.id = s.run_id AND r.app = s.app AND r.tenant = s.tenant AND r.state = 'paused'
 WHERE s.expires_at IS NOT NULL;

-- outbox_lag --
-- The metrics and doctor: outbox rows the relays have yet to publish (quarantined ones are not among them),
-- how long ago the oldest was written, and the quarantined rows. No parameters
SELECT count(*) FILTER (WHERE quarantined_at IS NULL) AS pending,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE quarantined_at IS NULL))::float8 AS oldest_seconds,
       count(*) FILTER (WHERE quarantined_at IS NOT NULL) AS quarantined
  FROM outbox
 WHERE sent_at IS NULL;

-- stale_leases --
-- Doctor: running runs whose lease lapsed more than $1 seconds ago (no worker took them over), oldest lapse
-- first, at most $2, each with how many there are in all. $1 grace seconds, $2 limit
SELECT id, app, tenant, lease_owner, extract(epoch FROM now() - lease_expires_at)::float8 AS lapsed_seconds,
       count(*) OVER () AS total
  FROM runs
 WHERE state = 'running' AND lease_expires_at <= now() - make_interval(secs => $1::float8)
 ORDER BY lease_expires_at
 LIMIT $2;

-- replication_status --
-- Doctor: the standbys streaming from this server (pg_stat_replication, on a primary), with how far behind
-- each replays, in bytes of WAL and in time; and whether this server is itself a standby. No parameters
SELECT pg_is_in_recovery() AS in_recovery, application_name, client_addr::text AS client_addr, state,
       sync_state,
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::float8 END AS lag_bytes,
       extract(epoch FROM replay_lag)::float8 AS lag_seconds
  FROM (SELECT 1) AS one
  LEFT JOIN pg_stat_replication ON true;
