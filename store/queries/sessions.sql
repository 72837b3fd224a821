-- load_session --
-- A session's messages in order, at the exact scope. $1 app, $2 tenant, $3 session_id
SELECT message FROM session_messages WHERE app = $1 AND tenant = $2 AND session_id = $3 ORDER BY id;
