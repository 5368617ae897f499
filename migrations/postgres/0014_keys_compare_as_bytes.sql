-- Resource keys, lock names and idempotency records' ids compare as bytes
-- (COLLATE "C"), whatever the database's collation.
--
-- They are identifiers: only their equality and, for listings, their byte
-- order mean anything. Under a linguistic collation (en_US.UTF-8, and
-- even C.UTF-8, which Postgres does not treat as "C") every comparison in
-- their unique indexes goes through the C library's strcoll, and that order
-- is the C library's: an operating system upgrade that changes it (glibc
-- 2.28 did, for most locales) leaves an index built under the old order
-- silently corrupt until it is rebuilt, and a corrupt unique index on
-- resource keys could let one key have two rows, each with its own highest
-- token. Byte order never changes. It is also cheaper: the listings' byte
-- ordered indexes of 0006 are the primary keys now, so a new key's insert
-- writes one index entry instead of two (bench/analysis.md).
--
-- Equality is the same under both (a deterministic collation calls equal
-- only what is byte-for-byte equal), so no two rows become duplicates, and
-- every statement keeps its meaning: a parameter's default collation
-- yields to the column's. The columns' type does not change, so no table
-- is rewritten; the indexes on these columns are rebuilt, and writes to
-- the three tables wait while they are (README, Upgrades, also for what
-- earlier versions still running see).
--
-- fence_resets keeps its collation: nothing unique depends on it, and
-- earlier versions' shared-mode instances read its keys back with a
-- prepared statement, which a new collation of a column it returns would
-- break ("cached plan must not change result type").
--
-- The rebuilds take time in proportion to the rows (1.8 s for a million
-- fence rows and a million records), so this migration lifts the statement
-- timeout a gateway's connections carry (a few store timeouts, which would
-- stop it, and the instance with it, on a large store). And it waits at
-- most 5 s for each table's lock: behind a long transaction on one of them
-- it fails (the instance stops at start-up, to be started again) rather than
-- queue every write of every instance behind its wait.
SET LOCAL statement_timeout = 0;
SET LOCAL lock_timeout = '5s';

ALTER TABLE fences ALTER COLUMN resource_key TYPE text COLLATE "C";
DROP INDEX IF EXISTS fences_key_bytes;

ALTER TABLE locks ALTER COLUMN name TYPE text COLLATE "C";
DROP INDEX IF EXISTS locks_name_bytes;

ALTER TABLE idempotency
    ALTER COLUMN route TYPE text COLLATE "C",
    ALTER COLUMN method TYPE text COLLATE "C",
    ALTER COLUMN idem_key TYPE text COLLATE "C";
