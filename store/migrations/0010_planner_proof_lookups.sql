-- Lookups by key that no planner estimate can turn into a scan of a whole tenant.
--
-- Every statement names a run by (id, app, tenant). Two indexes LED with (app, tenant) without the run id:
-- runs_live_by_session (app, tenant, session_id) and suspensions_by_scope (app, tenant, reason, run_id),
-- whose run_id sits behind reason and so cannot narrow a scan that does not name the reason. On a table
-- that has not been analysed yet (a new deployment, a new database; autovacuum analyses a minute or more
-- later) the planner takes "app = $ AND tenant = $" for a very selective condition and can choose either
-- of them over the unique key: every claim, end and pause then walked every live run (or pause) of its
-- tenant, a cost that grows with the tenant, measured at three to five times the work of the probe on a
-- thousand paused runs. A plan cached by a connection keeps that choice until the statistics change.
--
-- Rebuilt with the column every one of their readers names by equality first, neither can serve a lookup
-- by run id any more, so the unique keys (runs_pkey, runs_by_scope, suspensions_one_per_run) are the only
-- candidates for one, whatever the statistics say:
--   * the session prune's "a live run uses this session" names session_id, app and tenant (and reads the
--     run's state from the row);
--   * the reply discovery lists a scope's agent_reply pauses: reason, app and tenant, ordered by run_id.
-- The session index is no longer partial: a partial index whose condition a lookup implies (a run that is
-- 'paused' is one of the live states) may be read whole, without any condition of the lookup's, and on a
-- table that looks empty the planner found that as cheap as the key: a plan made then, and kept, walked it.
-- An index without a condition is read only where a lookup's condition bounds it (or for its order).
DROP INDEX runs_live_by_session;
CREATE INDEX runs_by_session ON runs (session_id, app, tenant);

DROP INDEX suspensions_by_scope;
CREATE INDEX suspensions_by_reason ON suspensions (reason, app, tenant, run_id);
