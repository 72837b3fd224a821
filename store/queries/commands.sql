-- read_for_command --
-- What a command is checked against before its transition, in one read at the exact scope: the run, its
-- live pause (composites, NULL when absent) and what the inbox recorded for the command's message_id
-- (i_, NULL when nothing). $1 run_id, $2 app, $3 tenant, $4 message_id (NULL: no inbox lookup)
SELECT r AS run, s AS pause, i.routing_key AS i_routing_key, i.body_digest AS i_body_digest,
       i.outcome AS i_outcome
  FROM (SELECT 1) AS one
  LEFT JOIN runs r ON r.id = $1 AND r.app = $2 AND r.tenant = $3
  LEFT JOIN suspensions s ON s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
  LEFT JOIN inbox i ON i.message_id = $4;
