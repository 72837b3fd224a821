-- decide_checkpoint --
-- Record an approval decision on a pending checkpoint, in the claiming transaction.
-- $1 checkpoint_id, $2 run_id, $3 state, $4 decided_by, $5 reason
UPDATE checkpoints
   SET state = $3, decided_by = $4, reason = $5, decided_at = now()
 WHERE id = $1 AND run_id = $2 AND state = 'pending'
RETURNING id;

-- run_state --
-- A run's state at the exact scope. $1 id, $2 app, $3 tenant
SELECT state FROM runs WHERE id = $1 AND app = $2 AND tenant = $3;

-- load_session --
-- A session's messages in order, at the exact scope. $1 app, $2 tenant, $3 session_id
SELECT message FROM session_messages WHERE app = $1 AND tenant = $2 AND session_id = $3 ORDER BY id;

-- append_session --
-- Append a run's own messages to its session. $1 app, $2 tenant, $3 session_id, $4 run_id, $5 messages
INSERT INTO session_messages (app, tenant, session_id, run_id, message)
SELECT $1, $2, $3, $4, m FROM jsonb_array_elements($5::jsonb) WITH ORDINALITY AS t (m, n) ORDER BY n;
