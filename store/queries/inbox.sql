-- record_inbox --
-- Record an accepted command, first thing in the transaction of its effect. A message_id recorded before
-- inserts nothing; a concurrent duplicate waits here until the first commits or rolls back.
-- $1 message_id, $2 routing_key, $3 body_digest, $4 outcome, $5 app, $6 tenant, $7 run_id
INSERT INTO inbox (message_id, routing_key, body_digest, outcome, app, tenant, run_id)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (message_id) DO NOTHING
RETURNING message_id;

-- get_inbox --
-- What was recorded for a message_id. $1 message_id
SELECT routing_key, body_digest, outcome, app, tenant, run_id, recorded_at FROM inbox WHERE message_id = $1;
