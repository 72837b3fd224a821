-- The engine's batch statements (engine/committer.py): each takes ONE array of a transition's composite
-- row (migration 0016), and the outbox hold in seconds ($2) for a transition whose events its writer
-- publishes from memory. Each returns one row per input row (some: any number), with the input row's
-- position n (from 1).

-- read_for_commands --
-- What each command is checked against before its transition, at its exact scope: the run, its live pause
-- (composites, NULL when absent), what the inbox recorded for the command's message_id at that scope (i_,
-- NULL when nothing: a message_id is a key within its scope) and the state of the checkpoint a decision
-- names (k_state, NULL when none is named or it is not this run's). Each lookup is a LATERAL subquery with
-- LIMIT 1, which the planner cannot flatten into a join: whatever it thinks of the array's length, every
-- lookup stays an index probe. $1 intermission_command_key_v1[]
SELECT a.n, rr.run, ss.pause, ii.routing_key AS i_routing_key, ii.body_digest AS i_body_digest,
       ii.outcome AS i_outcome, kk.state AS k_state
  FROM unnest($1::intermission_command_key_v1[])
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

-- read_evidence --
-- An agent-reply pause's evidence at its exact scope: its admission, the run's latest admission (the one
-- with the highest pause id), and the pause's start (composites, NULL when absent).
-- $1 intermission_pause_key_v1[]
SELECT a.n, ad.admission, la.latest, st.start
  FROM unnest($1::intermission_pause_key_v1[]) WITH ORDINALITY AS a(run_id, app, tenant, suspension_id, n)
  LEFT JOIN LATERAL (
      SELECT x AS admission FROM resume_admissions x
       WHERE x.run_id = a.run_id AND x.suspension_id = a.suspension_id AND x.app = a.app
         AND x.tenant = a.tenant) ad ON true
  LEFT JOIN LATERAL (
      SELECT x AS latest FROM resume_admissions x
       WHERE x.run_id = a.run_id AND x.app = a.app AND x.tenant = a.tenant
       ORDER BY x.suspension_id DESC LIMIT 1) la ON true
  LEFT JOIN LATERAL (
      SELECT x AS start FROM resume_starts x
       WHERE x.run_id = a.run_id AND x.suspension_id = a.suspension_id AND x.app = a.app
         AND x.tenant = a.tenant) st ON true
 ORDER BY a.n;

-- read_sessions --
-- Each session's most recent messages, at most `most` of them, oldest first, at the exact scope: a run's
-- snapshot holds what it loaded, so what it loads is bounded, not the whole age of the session.
-- $1 intermission_session_key_v1[]
SELECT a.n, m.message
  FROM unnest($1::intermission_session_key_v1[]) WITH ORDINALITY AS a(app, tenant, session_id, most, n)
 CROSS JOIN LATERAL (
      SELECT r.id, r.message FROM (
          SELECT x.id, x.message FROM session_messages x
           WHERE x.app = a.app AND x.tenant = a.tenant AND x.session_id = a.session_id
           ORDER BY x.id DESC
           LIMIT a.most) r
       ORDER BY r.id) m
 ORDER BY a.n, m.id;

-- draw_pause_keys --
-- The ids of pauses about to be written (and of their checkpoints, for approvals), drawn before the pause's
-- statement so that its Notice is encoded whole by the worker; and the database clock, which the pauses'
-- deadlines are counted from. A pause drawn for and never written leaves a gap in the ids, nothing more.
-- $1 intermission_pause_draw_v1[]
SELECT a.n, nextval('suspension_ids') AS suspension_id,
       CASE WHEN a.approval THEN nextval('checkpoints_id_seq') END AS checkpoint_id,
       clock_timestamp() AS db_now
  FROM unnest($1::intermission_pause_draw_v1[]) WITH ORDINALITY AS a(approval, n)
 ORDER BY a.n;

-- claim_pauses_v2 --
-- Claims of pauses (intermission_claim_pause_v1 for each row): the original's plain, expired-by, pinned and
-- leased claims, and the commands that answer a pause with everything that commits with them.
-- writes: outbox, inbox
SELECT * FROM intermission_claim_pauses_v2($1::intermission_claim_v2[], $2);

-- start_runs_v2 --
-- New runs (intermission_start_run_v2 for each row), within their scopes' quotas.
-- writes: inbox
SELECT * FROM intermission_start_runs_v2($1::intermission_start_v2[]);

-- save_progresses_v2 --
-- Step boundaries (intermission_save_progress_v1 for each row).
SELECT * FROM intermission_save_progresses_v2($1::intermission_save_v2[]);

-- pause_runs_v3 --
-- Pauses, each with its Notice whole (intermission_pause_run_v3).
-- writes: outbox
SELECT * FROM intermission_pause_runs_v3($1::intermission_pause_v3[], $2);

-- end_runs_v3 --
-- Ends, each with its run.* event whole (intermission_end_run_v3).
-- writes: outbox
SELECT * FROM intermission_end_runs_v3($1::intermission_end_v3[], $2);

-- request_endings_v2 --
-- Cancels of running runs (intermission_request_ending_v1 for each row).
-- writes: inbox
SELECT * FROM intermission_request_endings_v2($1::intermission_ending_v2[]);

-- admit_resumes_v2 --
-- Agent-reply admissions (intermission_admit_resume_v1 for each row).
-- writes: outbox, inbox
SELECT * FROM intermission_admit_resumes_v2($1::intermission_admission_v2[], $2);

-- start_resumes_v2 --
-- The single grant of execution of admitted replies (intermission_start_resume_v1 for each row).
SELECT * FROM intermission_start_resumes_v2($1::intermission_resume_start_v2[]);

-- expire_admissions_v1 --
-- Admissions that expired before they started (intermission_expire_admission_v1).
SELECT * FROM intermission_expire_admissions_v1($1::intermission_admission_expiry_v1[]);

-- close_resumes_v1 --
-- Closures of uncertain starts (intermission_close_resume_v1).
-- writes: outbox
SELECT * FROM intermission_close_resumes_v1($1::intermission_closure_v1[], $2);

-- move_deadlines_v2 --
-- Operators' moves of live pauses' deadlines (intermission_move_deadline_v1 for each row).
SELECT * FROM intermission_move_deadlines_v2($1::intermission_deadline_v2[]);

-- take_over_v2 --
-- Takeovers of runs whose lease lapsed (intermission_take_over_v1 for each row): a row per run taken.
SELECT n, taken_run AS run, taken_progress AS progress FROM intermission_take_over_v2($1::intermission_take_over_v2[]);

-- create_pauses_v2 --
-- The original's CreateSuspension (intermission_create_pause_v1 for each row). A NULL pause: no such run.
SELECT * FROM intermission_create_pauses_v2($1::intermission_create_pause_v2[]);

-- delete_pauses_v1 --
-- The original's DeleteSuspension, by run key.
SELECT * FROM intermission_delete_pauses_v1($1::intermission_run_key_v1[]);

-- delete_progresses_v1 --
-- The original's ProgressStore delete, by run key.
SELECT * FROM intermission_delete_progresses_v1($1::intermission_run_key_v1[]);

-- release_leases_v1 --
-- Leases let lapse now (a graceful stop), so another worker may take their runs at once.
SELECT * FROM intermission_release_leases_v1($1::intermission_run_key_v1[]);

-- retry_outbox_v1 --
-- Quarantined outbox rows handed back to the relays with a clean count, and every relay woken at commit
-- (rows made sendable by an UPDATE fire no insert trigger).
SELECT r.n, r.id FROM intermission_retry_outbox_v1($1::intermission_outbox_retry_v1[]) AS r
 CROSS JOIN LATERAL (SELECT pg_notify('intermission_outbox', '')) AS woken;
