-- save_progress --
-- SaveProgress (intermission_save_progress_v1) with the run's step and token counts. One row: when the
-- snapshot was written (NULL when owner does not hold a live lease on the run), and the end asked of the
-- run while it ran (NULL when none).
SELECT s.saved_at, s.ending
  FROM intermission_save_progress_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_owner => $4, p_continuation => $5, p_started => $6,
    p_done => $7, p_ending => $8, p_approved => $9, p_step_count => $10, p_tokens_used => $11) AS s;

-- save_progresses --
-- save_progress for several runs at once, in ONE statement (store/coalesce.py: runs that reach a step boundary
-- at the same moment share one round trip and one commit). Each array is one of save_progress's arguments in
-- its order ($1 run_ids ... $11 tokens_used), one element per snapshot, applied in the arrays' order (the
-- caller sorts them by run). One row per snapshot, as save_progress returns it, with its position n.
SELECT a.n, s.saved_at, s.ending
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[], $7::jsonb[],
              $8::jsonb[], $9::jsonb[], $10::int[], $11::bigint[])
       WITH ORDINALITY AS a(run_id, app, tenant, owner, continuation, started, done, ending, approved,
                            step_count, tokens_used, n)
 CROSS JOIN LATERAL intermission_save_progress_v1(
       a.run_id, a.app, a.tenant, a.owner, a.continuation, a.started, a.done, a.ending, a.approved,
       a.step_count, a.tokens_used) AS s
 ORDER BY a.n;

-- get_progress --
-- Read a run's snapshot at the exact scope. $1 run_id, $2 app, $3 tenant
SELECT run_id, app, tenant, owner, continuation, started, done, ending, approved, updated_at
  FROM progress
 WHERE run_id = $1 AND app = $2 AND tenant = $3;

-- delete_progress --
-- Remove a run's snapshot at the exact scope. $1 run_id, $2 app, $3 tenant
DELETE FROM progress WHERE run_id = $1 AND app = $2 AND tenant = $3;
