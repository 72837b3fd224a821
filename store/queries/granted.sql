-- Every statement in this file is a read of the web console (ops/console/), restricted IN ITS WHERE CLAUSE to
-- the scopes the broker grants the person logged in (store/granted.py). $1 every scope (boolean: an identity
-- trusted with the whole vhost), $2 and $3 the granted scopes' apps and tenants (text[], pairwise: the i-th
-- app with the i-th tenant); every statement takes these three first.

-- granted_approvals --
-- Approval pauses of paused runs waiting on a person, oldest first, with what the inbox shows of each: the
-- pending calls, the approvers, the deadline, and the run's revision (the pin of a decision) and config (its
-- publication policy says whether arguments are shown). $4 limit
SELECT s.id AS suspension_id, s.run_id, s.app, s.tenant, s.pending, s.checkpoint_id, s.approvers,
       s.expires_at, s.created_at, r.revision AS run_revision, r.agent_id, r.config
  FROM suspensions s
  JOIN runs r ON r.id = s.run_id AND r.app = s.app AND r.tenant = s.tenant
 WHERE s.reason = 'approval' AND r.state = 'paused'
   AND ($1::boolean OR (s.app, s.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)))
 ORDER BY s.created_at, s.id
 LIMIT $4;

-- granted_runs --
-- Runs in the given states, most recently changed first. $4 states (run_state[]), $5 limit
SELECT *
  FROM runs r
 WHERE r.state = ANY($4::run_state[])
   AND ($1::boolean OR (r.app, r.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)))
 ORDER BY r.updated_at DESC, r.id
 LIMIT $5;

-- granted_run --
-- One run at its exact scope. $4 run_id, $5 app, $6 tenant
SELECT *
  FROM runs r
 WHERE r.id = $4 AND r.app = $5 AND r.tenant = $6
   AND ($1::boolean OR (r.app, r.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)));

-- granted_run_pause --
-- A run's live pause at its exact scope, without its continuation (the executor's state, nothing to show).
-- $4 run_id, $5 app, $6 tenant
SELECT s.id, s.reason::text AS reason, s.pending, s.checkpoint_id, s.approvers, s.expires_at, s.created_at
  FROM suspensions s
 WHERE s.run_id = $4 AND s.app = $5 AND s.tenant = $6
   AND ($1::boolean OR (s.app, s.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)));

-- granted_run_checkpoints --
-- A run's approval decision points in order: who might decide, what was decided, by whom and why.
-- $4 run_id, $5 app, $6 tenant
SELECT k.id, k.suspension_id, k.approvers, k.state, k.decided_by, k.reason, k.created_at, k.decided_at
  FROM checkpoints k
 WHERE k.run_id = $4 AND k.app = $5 AND k.tenant = $6
   AND ($1::boolean OR (k.app, k.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)))
 ORDER BY k.id;

-- granted_run_events --
-- A run's metadata events (its history: each pause and its end) in order. $4 run_id, $5 app, $6 tenant
SELECT e.kind, e.revision, e.data, e.created_at
  FROM run_events e
 WHERE e.run_id = $4 AND e.app = $5 AND e.tenant = $6
   AND ($1::boolean OR (e.app, e.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)))
 ORDER BY e.id;

-- granted_run_outbox --
-- The events a run published or will publish, in order: where each goes and how far it got, never its body.
-- Sent rows are kept OUTBOX_RETENTION_SECONDS only. $4 run_id, $5 app, $6 tenant
SELECT o.message_id::text AS message_id, o.routing_key, o.created_at, o.sent_at, o.quarantined_at, o.attempts
  FROM outbox o
 WHERE o.run_id = $4 AND o.app = $5 AND o.tenant = $6
   AND ($1::boolean OR (o.app, o.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)))
 ORDER BY o.id;

-- granted_command_outcome --
-- What the inbox recorded for a command the console sent, at its exact scope: its outcome once a worker
-- applied it, no row while it waits or when it was refused. $4 app, $5 tenant, $6 message_id
SELECT i.outcome
  FROM inbox i
 WHERE i.app = $4 AND i.tenant = $5 AND i.message_id = $6
   AND ($1::boolean OR (i.app, i.tenant) IN (SELECT g.app, g.tenant
                                               FROM unnest($2::text[], $3::text[]) AS g(app, tenant)));
