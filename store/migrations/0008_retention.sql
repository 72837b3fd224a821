-- Bounded storage: what each table keeps, for how long, and the statements that prune the rest.
--
-- Nothing Intermission wrote used to be removed, so a fleet that ran for a year filled its disk. Now:
--   * an ended run, and everything about it (suspensions, checkpoints, progress, admissions, starts,
--     expiries, closures, run events, the demo ledger), is kept for INTERMISSION_RETENTION_SECONDS after it
--     ended, then removed in ONE transaction per batch of runs, so a run's rows go together or not at all;
--     a paused or running run is never pruned, whatever its age, and neither is its evidence;
--   * the inbox keeps a command's record for INTERMISSION_INBOX_RETENTION_SECONDS (the idempotency window):
--     a command re-sent after it is a new command. It is not pruned with its run: the window is the
--     window, whatever the run's retention;
--   * a sent outbox row is kept for INTERMISSION_OUTBOX_RETENTION_SECONDS (quarantined and unsent rows are
--     never pruned: they are work, not history);
--   * a session's messages older than INTERMISSION_SESSION_RETENTION_SECONDS are pruned, unless a live run
--     (created, running or paused) of that session may still read them.
-- Every prune takes a bounded batch with FOR UPDATE SKIP LOCKED, so any number of pruners run at once,
-- each row is deleted once, and a pruner never waits on a row a claim holds (nor a claim on a pruner for
-- longer than one batch's delete of rows nobody claims: ended runs are never claimed).

-- Ended runs by when they ended (ended_at is set by intermission_end_run_v1, the one place a run ends).
UPDATE runs SET ended_at = updated_at WHERE state IN ('completed', 'failed', 'cancelled') AND ended_at IS NULL;
CREATE INDEX runs_ended_by_age ON runs (ended_at) WHERE ended_at IS NOT NULL;

-- The sessions live runs read from, for the session prune's "unless a live run uses them".
CREATE INDEX runs_live_by_session ON runs (app, tenant, session_id) WHERE state IN ('created', 'running', 'paused');

-- Lease renewals rewrite a running run's lease_expires_at every few seconds. With that column in an index
-- (the old runs_running_by_lease), no renewal could be a heap-only update: each wrote a new index entry in
-- every index of runs and left a dead tuple for vacuum. The reclaim sweep needs the running runs, not an
-- order by expiry: an index of running runs' ids serves it (lapsed ones are filtered from the few running),
-- and renewals, which change neither state nor id, can stay heap-only where the page has room.
DROP INDEX runs_running_by_lease;
CREATE INDEX runs_running ON runs (id) WHERE state = 'running';
-- Room on each page for the new versions of its rows, so that those heap-only updates find it.
ALTER TABLE runs SET (fillfactor = 70);
ALTER TABLE progress SET (fillfactor = 70);

-- Sent events and inbox records by age: what the prunes walk, oldest first.
CREATE INDEX outbox_sent_by_age ON outbox (sent_at) WHERE sent_at IS NOT NULL;
CREATE INDEX inbox_by_age ON inbox (recorded_at);
CREATE INDEX session_messages_by_age ON session_messages (created_at);

-- The tables whose rows churn fastest (an outbox row is written, sent and pruned within minutes; progress
-- rows are rewritten at every step and deleted at every pause): vacuumed after a small fraction of their
-- rows changed, not the default fifth, so that dead tuples never pile up between runs of autovacuum.
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_insert_scale_factor = 0.05);
ALTER TABLE progress SET (autovacuum_vacuum_scale_factor = 0.02);
ALTER TABLE inbox SET (autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE runs SET (autovacuum_vacuum_scale_factor = 0.05);

-- One batch of ended runs past retention, with everything about them, in one transaction: the count of rows
-- removed per table. Oldest first; runs another pruner holds are skipped, not waited for. Rows that
-- reference others go first (closures, then expiries and starts, then the admissions they name): the
-- other order fails every batch that holds a run resumed by a reply on a foreign key.
CREATE FUNCTION intermission_prune_runs_v1(p_ended_before timestamptz, p_limit int)
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
