-- Per-scope quotas on starts, enforced in the transaction that would create the run.
--
-- One tenant starting thousands of runs used to be limited by nothing but the fleet's size: its runs took
-- every worker while other tenants' commands waited behind them. A scope may now hold at most a number of
-- live runs (not ended: created, running or paused) and start at most a number of runs a second (a token
-- bucket, whose burst is one second's worth). Both come from the fleet's settings, passed by the caller,
-- unless scope_quotas has a row for the scope; 0 means no limit. The start's checks lock the scope's bucket
-- row first, so two starts of one scope racing at the limit are taken one after the other and never both
-- admitted past it. A start refused by its quota writes nothing: no inbox record, no run, no token spent.
-- A start whose message_id the inbox already holds is answered as before (a duplicate or a conflict),
-- never refused by the quota it was admitted under.
--
-- intermission_start_run_v1 stays for workers of the previous version during a rolling deploy; they do not
-- enforce quotas. It can be dropped once no such worker runs (docs/store.md, "Functions in use").

CREATE TABLE scope_quotas (
    app text NOT NULL,
    tenant text NOT NULL,
    -- NULL: the fleet's default (INTERMISSION_QUOTA_LIVE_RUNS); 0: no limit.
    live_runs integer CHECK (live_runs >= 0),
    -- NULL: the fleet's default (INTERMISSION_QUOTA_STARTS_PER_SECOND); 0: no limit.
    starts_per_second double precision CHECK (starts_per_second >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (app, tenant)
);

CREATE TABLE scope_start_buckets (
    app text NOT NULL,
    tenant text NOT NULL,
    tokens double precision NOT NULL,
    refilled_at timestamptz NOT NULL,
    PRIMARY KEY (app, tenant)
);

CREATE FUNCTION intermission_start_run_v2(
    p_run_id text, p_app text, p_tenant text, p_agent_id text, p_input text, p_config jsonb, p_script jsonb,
    p_pause_ttl_seconds integer, p_session_id text, p_start_digest text,
    p_lease_owner text, p_lease_ttl float8,
    p_first_continuation jsonb,
    p_message_id text, p_routing_key text, p_digest text,
    p_default_live_runs integer, p_default_starts_per_second float8,
    OUT outcome text, OUT run runs, OUT first_updated_at timestamptz
) LANGUAGE plpgsql AS $$
DECLARE
    v_live_limit integer;
    v_rate float8;
    v_tokens float8;
    v_refilled timestamptz;
    v_live integer;
    v_started record;
BEGIN
    SELECT q.live_runs, q.starts_per_second INTO v_live_limit, v_rate
      FROM scope_quotas q WHERE q.app = p_app AND q.tenant = p_tenant;
    v_live_limit := coalesce(v_live_limit, p_default_live_runs, 0);
    v_rate := coalesce(v_rate, p_default_starts_per_second, 0);
    IF (v_live_limit > 0 OR v_rate > 0)
       AND NOT (p_message_id IS NOT NULL AND EXISTS (
           SELECT 1 FROM inbox i WHERE i.app = p_app AND i.tenant = p_tenant AND i.message_id = p_message_id)) THEN
        INSERT INTO scope_start_buckets (app, tenant, tokens, refilled_at)
        VALUES (p_app, p_tenant, greatest(v_rate, 1), now())
        ON CONFLICT (app, tenant) DO NOTHING;
        SELECT b.tokens, b.refilled_at INTO v_tokens, v_refilled
          FROM scope_start_buckets b WHERE b.app = p_app AND b.tenant = p_tenant
           FOR UPDATE;
        IF v_live_limit > 0 THEN
            SELECT count(*) INTO v_live
              FROM (SELECT 1 FROM runs r
                     WHERE r.app = p_app AND r.tenant = p_tenant AND r.ended_at IS NULL
                     LIMIT v_live_limit) AS live;
            IF v_live >= v_live_limit THEN
                outcome := 'quota_live_runs';
                RETURN;
            END IF;
        END IF;
        IF v_rate > 0 THEN
            -- The bucket refills at the rate, up to one second's worth (at least one start).
            v_tokens := least(greatest(v_rate, 1),
                              v_tokens + extract(epoch FROM clock_timestamp() - v_refilled) * v_rate);
            IF v_tokens < 1 THEN
                outcome := 'quota_starts_per_second';
                RETURN;
            END IF;
            UPDATE scope_start_buckets b SET tokens = v_tokens - 1, refilled_at = clock_timestamp()
             WHERE b.app = p_app AND b.tenant = p_tenant;
        END IF;
    END IF;
    SELECT * INTO v_started
      FROM intermission_start_run_v1(
        p_run_id, p_app, p_tenant, p_agent_id, p_input, p_config, p_script, p_pause_ttl_seconds, p_session_id,
        p_start_digest, p_lease_owner, p_lease_ttl, p_first_continuation, p_message_id, p_routing_key,
        p_digest) AS s;
    outcome := v_started.outcome;
    run := v_started.run;
    first_updated_at := v_started.first_updated_at;
END
$$;
