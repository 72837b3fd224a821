-- read_for_command --
-- What a command is checked against before its transition, in one read at the exact scope: the run, its
-- live pause (composites, NULL when absent), what the inbox recorded for the command's message_id at that
-- scope (i_, NULL when nothing: a message_id is a key within its scope, whatever other scopes used it) and
-- the state of the checkpoint a decision names (k_state, NULL when none is named or it is not this run's).
-- $1 run_id, $2 app, $3 tenant, $4 message_id (NULL: no inbox lookup), $5 checkpoint id (NULL: none)
SELECT r AS run, s AS pause, i.routing_key AS i_routing_key, i.body_digest AS i_body_digest,
       i.outcome AS i_outcome, k.state AS k_state
  FROM (SELECT 1) AS one
  LEFT JOIN runs r ON r.id = $1 AND r.app = $2 AND r.tenant = $3
  LEFT JOIN suspensions s ON s.run_id = r.id AND s.app = r.app AND s.tenant = r.tenant
  LEFT JOIN inbox i ON i.app = $2 AND i.tenant = $3 AND i.message_id = $4
  LEFT JOIN checkpoints k ON k.id = $5::bigint AND k.run_id = r.id AND k.app = r.app AND k.tenant = r.tenant;

-- read_for_commands --
-- read_for_command for a batch of commands (group commit, consumers/batching.py): one row per command, in
-- the arrays' order (n from 1), each read exactly as read_for_command reads one. Each lookup is a LATERAL
-- subquery with LIMIT 1, which the planner cannot flatten into a join: whatever it thinks of the arrays'
-- length, every lookup stays an index probe, never a scan of a large table. $1 run_ids, $2 apps, $3 tenants,
-- $4 message_ids (NULL elements: no inbox lookup), $5 checkpoint ids (NULL elements: none)
SELECT a.n, rr.run, ss.pause, ii.routing_key AS i_routing_key, ii.body_digest AS i_body_digest,
       ii.outcome AS i_outcome, kk.state AS k_state
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[])
       WITH ORDINALITY AS a(run_id, app, tenant, message_id, checkpoint_id, n)
  LEFT JOIN LATERAL (
      SELECT r AS run, r.id, r.app, r.tenant FROM runs r
       WHERE r.id = a.run_id AND r.app = a.app AND r.tenant = a.tenant LIMIT 1) rr ON true
  LEFT JOIN LATERAL (
      SELECT s AS pause FROM suspensions s
       WHERE s.run_id = rr.id AND s.app = rr.app AND s.tenant = rr.tenant LIMIT 1) ss ON true
  LEFT JOIN LATERAL (
      SELECT i.routing_key, i.body_digest, i.outcome FROM inbox i
       WHERE i.app = a.app AND i.tenant = a.tenant AND i.message_id = a.message_id LIMIT 1) ii ON true
  LEFT JOIN LATERAL (
      SELECT k.state FROM checkpoints k
       WHERE k.id = a.checkpoint_id AND k.run_id = rr.id AND k.app = rr.app AND k.tenant = rr.tenant
       LIMIT 1) kk ON true
 ORDER BY a.n;

-- recorded_command --
-- What the inbox recorded for a message_id at a scope, if anything. $1 app, $2 tenant, $3 message_id
SELECT routing_key, body_digest, outcome FROM inbox WHERE app = $1 AND tenant = $2 AND message_id = $3;

-- request_ending --
-- A cancel of a running run (intermission_request_ending_v1): the ending recorded for its lease holder to
-- finish, with the command's inbox record. One row: the outcome, and the run's revision and lease owner.
-- writes: inbox
SELECT q.outcome, q.revision, q.lease_owner
  FROM intermission_request_ending_v1(
    p_run_id => $1, p_app => $2, p_tenant => $3, p_ending => $4, p_message_id => $5, p_routing_key => $6,
    p_digest => $7) AS q;
