-- The inbox is keyed by (app, tenant, message_id): a message id is an idempotency key WITHIN a scope.
--
-- Keyed by message_id alone (0001), the inbox made every command id global: a tenant that used a command id
-- first, by accident or on purpose, turned another tenant's command under that id into a duplicate (no
-- effect, acknowledged quietly) or a message_id_conflict. Message ids are chosen by whoever publishes, so
-- no tenant can be asked to avoid the others' ids. Within one scope nothing changes: the same id again is
-- a duplicate, with another body a conflict. The transitions (0005) record, look up and remove a command's
-- record under the scope they are called at, and their ON CONFLICT names this key.
--
-- Existing rows stay: each message_id was unique on its own, so it is unique with its scope too. The key
-- leads with the scope because every lookup names the whole key. Building it holds the table for a moment
-- (ALTER TABLE takes an ACCESS EXCLUSIVE lock), which commands wait out like any short lock.
ALTER TABLE inbox DROP CONSTRAINT inbox_pkey;
ALTER TABLE inbox ADD CONSTRAINT inbox_pkey PRIMARY KEY (app, tenant, message_id);
