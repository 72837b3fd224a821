-- count_running --
-- Operational, across scopes: how many runs are running, and how many of those hold a live lease.
-- No parameters.
SELECT count(*) AS running,
       count(*) FILTER (WHERE lease_expires_at > now()) AS leased
  FROM runs
 WHERE state = 'running';

-- list_runs --
-- Operational, across scopes: the latest runs, newest first, optionally in one state. $1 state (NULL:
-- any), $2 limit
SELECT id, app, tenant, agent_id, state, revision, lease_owner, lease_expires_at, input, output, error,
       session_id, config, script, pause_ttl_seconds, step_count, tokens_used, created_at, updated_at
  FROM runs
 WHERE $1::run_state IS NULL OR state = $1::run_state
 ORDER BY updated_at DESC, id
 LIMIT $2;
