-- insert_demo_charge --
-- The demo `charge` tool's side effect: one ledger row per handler invocation, under the run's scope.
-- $1 app, $2 tenant, $3 run_id, $4 call_id, $5 amount
INSERT INTO demo_charges (app, tenant, run_id, call_id, amount) VALUES ($1, $2, $3, $4, $5) RETURNING id;

-- count_demo_charges --
-- How many times each call of a run was charged, at the run's exact scope. $1 app, $2 tenant, $3 run_id
SELECT call_id, count(*) AS times
  FROM demo_charges
 WHERE app = $1 AND tenant = $2 AND run_id = $3
 GROUP BY call_id
 ORDER BY call_id;
