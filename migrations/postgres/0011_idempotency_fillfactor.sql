-- Idempotency records are written twice: inserted in flight, then updated
-- with their answer a few milliseconds later. With every page filled by
-- inserts, the update found no room beside its row and wrote the new
-- version on another page, with new entries in both indexes (9 updates in
-- 10 under fresh keys). Pages filled to half leave room for the answer, so
-- the update is a heap-only tuple update: no index is touched (neither
-- indexed column changes). Applies to pages written from now on.
ALTER TABLE idempotency SET (fillfactor = 50);
