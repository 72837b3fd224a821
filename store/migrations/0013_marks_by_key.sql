-- Outbox rows are marked sent one key probe at a time, whatever the planner thinks of the outbox's size.
--
-- The relay and the hand-over marked their confirmed rows with one statement over an array of keys
-- ("WHERE message_id = ANY($1)"). A plan for an array of unknown length prices an index probe per element
-- against one pass over the table, and on an outbox not yet analysed (a new database, the first minute of
-- a deployment: autovacuum analyses a minute or more later) one pass looked cheaper: the plan a session
-- made then and kept walked the whole outbox for every batch marked, a cost that grows with the outbox
-- (sent rows stay for OUTBOX_RETENTION_SECONDS). Marking each key with its own statement gives the planner
-- one value against a unique index, which it probes whatever the statistics say; the keys are taken in
-- order, so two markers of overlapping rows lock them in the same order. Each returns how many rows it
-- marked.

CREATE FUNCTION intermission_mark_sent_v1(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_marked integer := 0;
    v_one integer;
BEGIN
    FOR v_id IN SELECT DISTINCT i FROM unnest(p_ids) AS i ORDER BY i LOOP
        UPDATE outbox SET sent_at = now() WHERE id = v_id AND sent_at IS NULL;
        GET DIAGNOSTICS v_one = ROW_COUNT;
        v_marked := v_marked + v_one;
    END LOOP;
    RETURN v_marked;
END;
$$;

CREATE FUNCTION intermission_mark_handed_sent_v1(p_message_ids uuid[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_message_id uuid;
    v_marked integer := 0;
    v_one integer;
BEGIN
    FOR v_message_id IN SELECT DISTINCT m FROM unnest(p_message_ids) AS m ORDER BY m LOOP
        UPDATE outbox SET sent_at = now(), next_attempt_at = NULL
         WHERE message_id = v_message_id AND sent_at IS NULL;
        GET DIAGNOSTICS v_one = ROW_COUNT;
        v_marked := v_marked + v_one;
    END LOOP;
    RETURN v_marked;
END;
$$;
