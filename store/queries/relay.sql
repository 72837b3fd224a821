-- claim_unsent_outbox --
-- The relay's batch: up to $1 unsent outbox rows, oldest first, locked for the caller's transaction.
-- SKIP LOCKED passes over rows another relay holds, so two relays never publish the same row at the same
-- time and neither waits for the other. $1 limit
SELECT id, message_id, routing_key, body, correlation_id, headers
  FROM outbox
 WHERE sent_at IS NULL
 ORDER BY id
 LIMIT $1
   FOR UPDATE SKIP LOCKED;

-- mark_outbox_sent --
-- Rows whose publisher confirm arrived, marked in the transaction that claimed them, by the database
-- clock. $1 outbox ids (bigint[])
UPDATE outbox
   SET sent_at = now()
 WHERE id = ANY($1::bigint[]) AND sent_at IS NULL;

-- count_unsent_outbox --
-- How many outbox rows wait for the relay (drain checks, metrics). No parameters
SELECT count(*) FROM outbox WHERE sent_at IS NULL;

-- outbox_listener_ping --
-- Proves the relay's LISTEN connection still answers (a dead peer sends no FIN). No parameters
SELECT 1;
