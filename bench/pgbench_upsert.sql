-- (g) pgbench custom script: the single-row conditional upsert a fence store
-- does per decision, one statement per transaction (autocommit).
-- :n is a per-client counter (pgbench keeps a client's variables across
-- transactions; run.sh starts it with -D n=0) and :nc the client count
-- (-D nc=64), so tokens rise for every client and are unique across clients:
-- t = n*nc + client_id + 2. Keys are uniform over k0..k9999.
\set n :n + 1
\set k random(0, 9999)
\set t :n * :nc + :client_id + 2
INSERT INTO fences_bench(resource_key, highest_token) VALUES ('k' || :k, :t) ON CONFLICT (resource_key) DO UPDATE SET highest_token = EXCLUDED.highest_token WHERE fences_bench.highest_token < EXCLUDED.highest_token;
