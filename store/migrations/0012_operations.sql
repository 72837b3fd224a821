-- What operators do to a live pause (`intermission pauses extend|expire`), as a transition like every other
-- (0005_transitions.sql): one versioned function, named parameters, one statement, refusals returned.

-- A live pause's deadline moved by an operator, as ONE transition: the pause's expires_at, and a run event
-- (kind 'deadline_moved': the pause, the deadline before and after, who moved it) so that the change is on
-- the run's record. Pinned to the live pause: the run must be PAUSED on exactly p_suspension_id at that
-- scope, so a pause answered, expired or replaced meanwhile is refused rather than a newer one moved.
--
-- p_extend_by set (seconds, > 0): the deadline moves that much later than it stood, counted from now when it
-- has passed already or the pause had none (an operator giving a run more time means more time from here).
-- p_extend_by NULL: the deadline moves to now, unless it passed already (then it stays: an expiry is never
-- put off by asking for one); the caller then publishes the sweeper's run.expire for it, and a worker claims
-- the expiry exactly as for a natural one. The run's revision does not change: a deadline is not a state,
-- and hosts' pending answers (pinned to the revision) stay valid. The Notice already published keeps the old
-- deadline; the run event is the record of the new one.
--
-- Outcomes: 'moved' (expires_at is the new deadline, previous the old one, run_revision the run's);
-- 'not_paused' (no such run at that scope, or it is not paused); 'pause_changed' (paused on another pause
-- than p_suspension_id: suspension_id says which).
CREATE FUNCTION intermission_move_deadline_v1(
    p_run_id text, p_app text, p_tenant text, p_suspension_id bigint, p_extend_by float8, p_moved_by text,
    OUT outcome text, OUT suspension_id bigint, OUT run_revision bigint, OUT previous timestamptz,
    OUT expires_at timestamptz
) LANGUAGE plpgsql AS $$
DECLARE
    v_result record;
BEGIN
    IF p_extend_by IS NOT NULL AND NOT (p_extend_by > 0 AND p_extend_by < 'infinity'::float8) THEN
        RAISE EXCEPTION 'p_extend_by must be a positive, finite number of seconds' USING ERRCODE = '22023';
    END IF;
    -- The run's row lock first, as every claim takes it: a claim racing this move waits for it (and then
    -- judges the pause by its new deadline), or this waits for the claim and finds the run no longer paused.
    WITH held AS (
        SELECT r.id, r.revision FROM runs r
         WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'paused'
           FOR UPDATE
    ), found AS (
        SELECT s.id, s.expires_at AS old_deadline, h.revision FROM suspensions s JOIN held h ON h.id = s.run_id
         WHERE s.app = p_app AND s.tenant = p_tenant AND s.id = p_suspension_id
           FOR UPDATE OF s
    ), moved AS (
        UPDATE suspensions s
           SET expires_at = CASE
               WHEN p_extend_by IS NULL THEN LEAST(COALESCE(f.old_deadline, now()), now())
               ELSE GREATEST(COALESCE(f.old_deadline, now()), now()) + make_interval(secs => p_extend_by)
           END
          FROM found f
         WHERE s.id = f.id
        RETURNING s.id, s.expires_at, f.old_deadline, f.revision
    ), noted AS (
        INSERT INTO run_events (event_id, run_id, app, tenant, kind, revision, data)
        SELECT gen_random_uuid(), p_run_id, p_app, p_tenant, 'deadline_moved', m.revision,
               jsonb_build_object('suspension_id', m.id, 'previous', m.old_deadline, 'expires_at', m.expires_at,
                                  'moved_by', p_moved_by,
                                  'how', CASE WHEN p_extend_by IS NULL THEN 'expire' ELSE 'extend' END,
                                  'extend_by_seconds', p_extend_by)
          FROM moved m
    )
    SELECT m.id, m.expires_at, m.old_deadline, m.revision INTO v_result FROM moved m;

    IF v_result.id IS NOT NULL THEN
        outcome := 'moved';
        suspension_id := v_result.id;
        run_revision := v_result.revision;
        previous := v_result.old_deadline;
        expires_at := v_result.expires_at;
        RETURN;
    END IF;
    SELECT s.id, r.revision INTO suspension_id, run_revision
      FROM runs r LEFT JOIN suspensions s ON s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
     WHERE r.id = p_run_id AND r.app = p_app AND r.tenant = p_tenant AND r.state = 'paused';
    outcome := CASE WHEN suspension_id IS NULL THEN 'not_paused' ELSE 'pause_changed' END;
END;
$$;
