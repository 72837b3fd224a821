-- load_session --
-- A session's most recent messages, at most $4 of them, in order, at the exact scope: a run's snapshot holds
-- what it loaded, so what it loads is bounded, not the whole age of the session.
-- $1 app, $2 tenant, $3 session_id, $4 most messages
SELECT message FROM (
    SELECT id, message FROM session_messages
     WHERE app = $1 AND tenant = $2 AND session_id = $3
     ORDER BY id DESC
     LIMIT $4::int
) recent ORDER BY id;
