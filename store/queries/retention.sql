-- prune_runs --
-- One batch of ended runs past retention and everything about them, in one transaction (the function's
-- own): the rows removed per table, as jsonb. Runs another pruner holds are skipped.
-- $1 ended before (seconds ago), $2 batch size
SELECT intermission_prune_runs_v1(now() - make_interval(secs => $1::float8), $2::int) AS counts;

-- prune_inbox --
-- One batch of inbox records older than the idempotency window, oldest first.
-- $1 seconds, $2 batch size
WITH doomed AS (
    SELECT i.app, i.tenant, i.message_id
      FROM inbox i
     WHERE i.recorded_at < now() - make_interval(secs => $1::float8)
     ORDER BY i.recorded_at
     LIMIT $2::int
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM inbox i USING doomed d
     WHERE i.app = d.app AND i.tenant = d.tenant AND i.message_id = d.message_id
    RETURNING 1
)
SELECT count(*) AS pruned FROM gone;

-- prune_outbox --
-- One batch of sent outbox rows past retention, oldest first; unsent and quarantined rows are never taken,
-- nor the Notices of a run that is paused: `intermission notices replay` re-publishes a live pause's Notice
-- under the message_id its row keeps. $1 seconds, $2 batch size
WITH doomed AS (
    SELECT o.id
      FROM outbox o
     WHERE o.sent_at IS NOT NULL AND o.sent_at < now() - make_interval(secs => $1::float8)
       AND NOT (o.routing_key LIKE 'notice.%' AND EXISTS (
           SELECT 1 FROM runs r
            WHERE r.id = o.run_id AND r.app = o.app AND r.tenant = o.tenant AND r.state = 'paused'))
     ORDER BY o.sent_at
     LIMIT $2::int
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM outbox o USING doomed d WHERE o.id = d.id RETURNING 1
)
SELECT count(*) AS pruned FROM gone;

-- prune_sessions --
-- One batch of session messages past retention whose session no live run (created, running, paused) uses.
-- $1 seconds, $2 batch size
WITH doomed AS (
    SELECT s.id
      FROM session_messages s
     WHERE s.created_at < now() - make_interval(secs => $1::float8)
       AND NOT EXISTS (
           SELECT 1 FROM runs r
            WHERE r.app = s.app AND r.tenant = s.tenant AND r.session_id = s.session_id
              AND r.state IN ('created', 'running', 'paused'))
     ORDER BY s.created_at
     LIMIT $2::int
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM session_messages s USING doomed d WHERE s.id = d.id RETURNING 1
)
SELECT count(*) AS pruned FROM gone;

-- prunable --
-- What a prune would remove now, per table, without removing anything (`intermission prune --dry-run`).
-- $1 run retention, $2 inbox window, $3 outbox retention, $4 session retention (all seconds)
-- `ended` names its runs by the key every table of a run's rows has (app, tenant, run_id), so each count
-- below joins on that key by name.
WITH ended AS (
    SELECT r.app, r.tenant, r.id AS run_id FROM runs r
     WHERE r.ended_at IS NOT NULL AND r.ended_at < now() - make_interval(secs => $1::float8)
       AND r.state IN ('completed', 'failed', 'cancelled')
)
SELECT (SELECT count(*) FROM ended) AS runs,
       (SELECT count(*) FROM suspensions JOIN ended USING (app, tenant, run_id)) AS suspensions,
       (SELECT count(*) FROM checkpoints JOIN ended USING (app, tenant, run_id)) AS checkpoints,
       (SELECT count(*) FROM progress JOIN ended USING (app, tenant, run_id)) AS progress,
       (SELECT count(*) FROM resume_admissions JOIN ended USING (app, tenant, run_id)) AS resume_admissions,
       (SELECT count(*) FROM resume_starts JOIN ended USING (app, tenant, run_id)) AS resume_starts,
       (SELECT count(*) FROM resume_expiries JOIN ended USING (app, tenant, run_id)) AS resume_expiries,
       (SELECT count(*) FROM resume_closures JOIN ended USING (app, tenant, run_id)) AS resume_closures,
       (SELECT count(*) FROM run_events JOIN ended USING (app, tenant, run_id)) AS run_events,
       (SELECT count(*) FROM demo_charges JOIN ended USING (app, tenant, run_id)) AS demo_charges,
       (SELECT count(*) FROM inbox i WHERE i.recorded_at < now() - make_interval(secs => $2::float8)) AS inbox,
       (SELECT count(*) FROM outbox o
         WHERE o.sent_at IS NOT NULL AND o.sent_at < now() - make_interval(secs => $3::float8)
           AND NOT (o.routing_key LIKE 'notice.%' AND EXISTS (
               SELECT 1 FROM runs r
                WHERE r.id = o.run_id AND r.app = o.app AND r.tenant = o.tenant AND r.state = 'paused'))) AS outbox,
       (SELECT count(*) FROM session_messages s
         WHERE s.created_at < now() - make_interval(secs => $4::float8)
           AND NOT EXISTS (
               SELECT 1 FROM runs r
                WHERE r.app = s.app AND r.tenant = s.tenant AND r.session_id = s.session_id
                  AND r.state IN ('created', 'running', 'paused'))) AS session_messages;

-- storage --
-- Each table of Intermission's with its live rows (the statistics' estimate), dead tuples and size on disk
-- (table, indexes and TOAST).
SELECT c.relname AS name,
       coalesce(s.n_live_tup, 0) AS live_rows,
       coalesce(s.n_dead_tup, 0) AS dead_rows,
       pg_total_relation_size(c.oid) AS bytes
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
  LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
 WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname <> 'schema_migrations'
 ORDER BY c.relname;

-- oldest_kept --
-- How long ago the oldest ended run still kept ended, and the oldest inbox record was written (seconds;
-- NULL when there is none): how far behind retention pruning is.
SELECT (SELECT extract(epoch FROM now() - min(r.ended_at)) FROM runs r WHERE r.ended_at IS NOT NULL)::float8
           AS ended_run_seconds,
       (SELECT extract(epoch FROM now() - min(i.recorded_at)) FROM inbox i)::float8 AS inbox_seconds;
