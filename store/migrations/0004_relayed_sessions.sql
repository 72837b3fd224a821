-- A process that runs an outbox relay wakes it itself when it commits outbox rows (store/db.py), so its
-- sessions need not notify anybody: a NOTIFY per commit woke EVERY worker's relay for every event, which
-- cost more than the events as the fleet grew (bench/resume.py: about 0.2 ms of PostgreSQL CPU per resume
-- with one worker, and 17 % of the throughput with two). Such sessions say so with the session setting
-- intermission.relayed = on. Everybody else (a host using the store, the CLI, a process without a relay)
-- still notifies, so the fleet's relays publish their rows at once.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('intermission.relayed', true) IS DISTINCT FROM 'on' THEN
        PERFORM pg_notify('intermission_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;
