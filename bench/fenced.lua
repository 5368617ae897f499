-- wrk script shared by every HTTP scenario of bench/run.sh.
--
--   wrk -t2 -c64 -d10s -s bench/fenced.lua http://127.0.0.1:PORT -- MODE NKEYS PREFIX THREADS
--
-- MODE:
--   get    GET  /docs/<PREFIX><n>, n random in [0, NKEYS)
--   reuse  PUT  /docs/<PREFIX><n>, n random, X-Fence-Token: 1 (the keys' current token)
--   raise  PUT  with a token that rises on every request to a key: thread t of T
--          owns the keys n with n % T == t and walks them round robin with its own
--          counter c; the token is 2 + c*T + t, so each request to a key carries a
--          higher token than the previous one on that key (and is > 1, the seed)
--   stale  PUT  /docs/<PREFIX><n>, n random, X-Fence-Token: 0 (below the seeded 1)
--   fresh  POST /keyed/<PREFIX><n>, n random, X-Fence-Token: 1, and an Idempotency-Key
--          never sent before (run nonce, thread id, counter): every request is a
--          first use
--   replay POST /keyed/<PREFIX>1, X-Fence-Token: 1, Idempotency-Key: bench-replay,
--          the same body: every request replays the answer run.sh stored first
--
-- The keyed modes send Content-Type: text/plain (part of the key's fingerprint,
-- like the body and the token: run.sh's probe and oha send the same).
--
-- Every mode uses the same machinery (requests built in init(), one response()
-- hook counting status classes), so the client does about the same work per
-- request in every scenario and the ratios compare the servers, not the
-- scripts: raise and fresh splice their changing value into a request built
-- in init() (see SLOT).
-- done() prints one line "BENCHJSON {...}" that bench/run.sh parses.

local threads = {}
local next_id = 0

function setup(thread)
   thread:set("id", next_id)
   next_id = next_id + 1
   table.insert(threads, thread)
end

local body = "written-by-bench"

-- Where a header value that changes per request goes: each key's request
-- is formatted once with SLOT as that value and split there, and a request
-- is the two halves with the value between them. One concatenation per
-- request, so the modes whose requests change cost the client about what
-- a lookup of a ready request costs (with wrk.format per request, wrk
-- spent 12.4-13.6 us of CPU per raising write; spliced, 9.8-10.0).
SLOT = "@SLOT@"

function split_at(format)
   local heads, tails = {}, {}
   for n = 0, nkeys - 1 do
      local r = format(n)
      local at = string.find(r, SLOT, 1, true)
      heads[n], tails[n] = string.sub(r, 1, at - 1), string.sub(r, at + #SLOT)
   end
   return heads, tails
end

function init(args)
   mode   = args[1] or "get"
   nkeys  = tonumber(args[2] or "10000")
   prefix = args[3] or "k"
   nthreads = tonumber(args[4] or "2")  -- must equal wrk -t
   s2xx, s409, sother = 0, 0, 0
   math.randomseed(os.time() * 1000 + id * 7919)

   reqs = {}
   if mode == "get" then
      for n = 0, nkeys - 1 do
         reqs[n] = wrk.format("GET", "/docs/" .. prefix .. n, {}, nil)
      end
   elseif mode == "reuse" or mode == "stale" then
      local token = (mode == "reuse") and "1" or "0"
      for n = 0, nkeys - 1 do
         reqs[n] = wrk.format("PUT", "/docs/" .. prefix .. n, { ["X-Fence-Token"] = token }, body)
      end
   elseif mode == "raise" then
      counter = 0
      owned = math.floor(nkeys / nthreads)
      heads, tails = split_at(function(n)
         return wrk.format("PUT", "/docs/" .. prefix .. n, { ["X-Fence-Token"] = SLOT }, body)
      end)
   elseif mode == "fresh" then
      counter = 0
      nonce = "f" .. tostring(os.time()) .. "-" .. tostring(math.random(0, 999999)) .. "-" .. id .. "-"
      heads, tails = split_at(function(n)
         return wrk.format("POST", "/keyed/" .. prefix .. n, {
            ["X-Fence-Token"] = "1",
            ["Content-Type"] = "text/plain",
            ["Idempotency-Key"] = SLOT,
         }, body)
      end)
   elseif mode == "replay" then
      reqs[0] = wrk.format("POST", "/keyed/" .. prefix .. "1", {
         ["X-Fence-Token"] = "1",
         ["Content-Type"] = "text/plain",
         ["Idempotency-Key"] = "bench-replay",
      }, body)
      nkeys = 1
   else
      error("unknown mode " .. tostring(mode))
   end
end

function request()
   if mode == "raise" then
      local n = (counter % owned) * nthreads + id
      local token = 2 + counter * nthreads + id
      counter = counter + 1
      return heads[n] .. token .. tails[n]
   elseif mode == "fresh" then
      local n = math.random(0, nkeys - 1)
      counter = counter + 1
      return heads[n] .. nonce .. counter .. tails[n]
   end
   return reqs[math.random(0, nkeys - 1)]
end

function response(status, headers, body)
   if status >= 200 and status < 300 then
      s2xx = s2xx + 1
   elseif status == 409 then
      s409 = s409 + 1
   else
      sother = sother + 1
   end
end

function done(summary, latency, requests)
   local a, b, c = 0, 0, 0
   for _, t in ipairs(threads) do
      a = a + t:get("s2xx")
      b = b + t:get("s409")
      c = c + t:get("sother")
   end
   local e = summary.errors
   io.write(string.format(
      'BENCHJSON {"duration_us": %d, "requests": %d, "s2xx": %d, "s409": %d, "sother": %d, ' ..
      '"err_connect": %d, "err_read": %d, "err_write": %d, "err_timeout": %d, ' ..
      '"p50_us": %d, "p99_us": %d}\n',
      summary.duration, summary.requests, a, b, c,
      e.connect, e.read, e.write, e.timeout,
      latency:percentile(50), latency:percentile(99)))
end
