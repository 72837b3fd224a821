-- save_progress --
-- SaveProgress (intermission_save_progress_v1) with the run's step and token counts. One row: when the
-- snapshot was written (NULL when owner does not hold a live lease on the run), and the end asked of the
-- run while it ran (NULL when none).
SELECT s.saved_at, s.ending
  FROM intermission_save_progress_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_owner => $4, p_continuation => $5, p_started => $6,
    p_done => $7, p_ending => $8, p_approved => $9, p_step_count => $10, p_tokens_used => $11) AS s;

-- get_progress --
-- Read a run's snapshot at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT run_id, app, tenant, owner, continuation, started, done, ending, approved, updated_at
  FROM progress
 WHERE run_id = $1 AND app = $2 AND tenant = $3;

-- delete_progress --
-- Remove a run's snapshot at the exact scope. $1 run_id, $2 app, $3 tenant
DELETE FROM progress WHERE run_id = $1 AND app = $2 AND tenant = $3;
