-- migrations_table --
-- Create the table that records applied migrations. No parameters.
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- migrations_lock --
-- Take the session advisory lock that serialises migrators. $1 lock key.
SELECT pg_advisory_lock($1);

-- migrations_unlock --
-- Release it. $1 lock key.
SELECT pg_advisory_unlock($1);

-- migrations_applied --
-- Applied migrations in order. No parameters.
SELECT version, name, checksum FROM schema_migrations ORDER BY version;

-- migrations_record --
-- Record one applied migration. $1 version, $2 name, $3 checksum.
INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3);

-- database_exists --
-- Whether a database exists. $1 name.
SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1);
