-- list_outbox_for_run --
-- A run's outbox rows in order (the CLI and the tests). $1 run_id, $2 app, $3 tenant
SELECT message_id, routing_key, body, correlation_id, headers, created_at, sent_at
  FROM outbox
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY id;

-- outbox_listener_ping --
-- Proves the relay's LISTEN connection still answers (a dead peer sends no FIN). No parameters
SELECT 1;

-- list_run_outbox --
-- Operators (`intermission runs show`): a run's outbox rows in order, without their bodies (the hosts'
-- data), with where each stands. $1 run_id, $2 app, $3 tenant
SELECT id, message_id::text AS message_id, routing_key, correlation_id, headers, created_at, sent_at, attempts,
       next_attempt_at, quarantined_at, last_error
  FROM outbox
 WHERE run_id = $1 AND app = $2 AND tenant = $3
 ORDER BY id;

-- notice_of_pause --
-- Operators (`intermission notices replay`): the outbox row that carried the Notice of pause $4, whole, so
-- that it is published again exactly as it was. $1 run_id, $2 app, $3 tenant, $4 suspension id
SELECT id, message_id::text AS message_id, routing_key, body, correlation_id, headers
  FROM outbox
 WHERE run_id = $1 AND app = $2 AND tenant = $3 AND routing_key LIKE 'notice.%'
   AND (body::jsonb ->> 'suspension_id') = $4::bigint::text
 ORDER BY id DESC
 LIMIT 1;
