-- insert_outbox --
-- An event to publish, in the transaction of the change that caused it. $1 message_id, $2 routing_key,
-- $3 body, $4 correlation_id, $5 headers, $6 app, $7 tenant, $8 run_id
INSERT INTO outbox (message_id, routing_key, body, correlation_id, headers, app, tenant, run_id)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8);

-- list_outbox_for_run --
-- A run's outbox rows in order (tests and the CLI). $1 run_id, $2 app, $3 tenant
SELECT message_id, routing_key, body, correlation_id, headers, created_at, sent_at
  FROM outbox
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY id;
