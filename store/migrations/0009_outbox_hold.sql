-- Events published from memory right after their commit (publishers/relay.py, "handed over").
--
-- A command's claim knows its run.resumed event whole before the transaction starts, so the worker that
-- commits it publishes it from memory at once and marks its row sent afterwards, instead of the relay
-- reading the row back, publishing it and marking it. The row is still written by the claim, in its
-- transaction: it stays the durable record, and the relay's poll publishes it if the worker dies between
-- the commit and the confirm. Only, the relays must not race the worker for it meanwhile (two
-- publications of every event: harmless to subscribers, which deduplicate on message_id, but it would
-- cost what handing over saves). So a statement that hands its events over first calls
-- intermission_hold_outbox_v1(seconds): for the rest of ITS transaction, every outbox row it inserts
-- waits that long before a relay may claim it (next_attempt_at, the column a refused row waits on
-- already). Rows of every other transaction are due at once, as before.
CREATE FUNCTION intermission_hold_outbox_v1(p_outbox_hold double precision) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT set_config('intermission.outbox_hold_seconds', COALESCE(p_outbox_hold::text, ''), true) IS NOT NULL;
$$;

ALTER TABLE outbox ALTER COLUMN next_attempt_at SET DEFAULT (
    now() + make_interval(secs => nullif(current_setting('intermission.outbox_hold_seconds', true), '')::float8)
);
