-- insert_demo_charge --
-- The demo `charge` tool's side effect: one ledger row per handler invocation. $1 run_id, $2 call_id,
-- $3 amount
INSERT INTO demo_charges (run_id, call_id, amount) VALUES ($1, $2, $3) RETURNING id;

-- count_demo_charges --
-- How many times each call of a run was charged. $1 run_id
SELECT call_id, count(*) AS times FROM demo_charges WHERE run_id = $1 GROUP BY call_id ORDER BY call_id;
