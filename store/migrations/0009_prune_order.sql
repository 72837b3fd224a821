-- intermission_prune_runs_v1 (0008) deleted a run's resume admissions before the starts and expiries that
-- reference them, and the starts before their closures: any ended run that had been resumed by a reply
-- (run.reply admits, then starts, the resume) failed the whole batch with a foreign-key violation, so no run
-- of that batch, nor any after it, was ever pruned (found by bench/storage.py). v2 deletes referencing rows
-- first: closures, then expiries and starts, then admissions. v1 stays for the workers of the release before
-- (a function is never edited once released, 0005) and goes with a later migration.

-- One batch of ended runs past retention, with everything about them, in one transaction: the count of rows
-- removed per table. Oldest first; runs another pruner holds are skipped, not waited for.
CREATE FUNCTION intermission_prune_runs_v2(p_ended_before timestamptz, p_limit int)
RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_ids text[];
    v_counts jsonb := '{}';
    v_n bigint;
BEGIN
    SELECT coalesce(array_agg(r.id), '{}') INTO v_ids
      FROM (SELECT r.id FROM runs r
             WHERE r.ended_at IS NOT NULL AND r.ended_at < p_ended_before
               AND r.state IN ('completed', 'failed', 'cancelled')
             ORDER BY r.ended_at
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED) r;
    IF cardinality(v_ids) = 0 THEN
        RETURN v_counts;
    END IF;
    DELETE FROM suspensions WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('suspensions', v_n);
    DELETE FROM checkpoints WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('checkpoints', v_n);
    DELETE FROM progress WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('progress', v_n);
    DELETE FROM resume_closures WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_closures', v_n);
    DELETE FROM resume_expiries WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_expiries', v_n);
    DELETE FROM resume_starts WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_starts', v_n);
    DELETE FROM resume_admissions WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('resume_admissions', v_n);
    DELETE FROM run_events WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('run_events', v_n);
    DELETE FROM demo_charges WHERE run_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('demo_charges', v_n);
    DELETE FROM runs WHERE id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT; v_counts := v_counts || jsonb_build_object('runs', v_n);
    RETURN v_counts;
END;
$$;
