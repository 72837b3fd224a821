-- list_outbox_for_run --
-- A run's outbox rows in order (the CLI and the tests). $1 run_id, $2 app, $3 tenant
SELECT message_id, routing_key, body, correlation_id, headers, created_at, sent_at
  FROM outbox
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY id;

-- outbox_listener_ping --
-- Proves the relay's LISTEN connection still answers (a dead peer sends no FIN). No parameters
SELECT 1;
