-- wrk script: POST one body per request, cycling through a file of JSON bodies (one per
-- line, the path given after `--`), and print the run's figures as one JSON line.
local bodies = {}
local next_body = 0

function init(args)
  local f = assert(io.open(args[1], "r"))
  for line in f:lines() do
    bodies[#bodies + 1] = line
  end
  f:close()
  next_body = math.random(#bodies)
end

function request()
  next_body = next_body % #bodies + 1
  return wrk.format("POST", nil, { ["Content-Type"] = "application/json" }, bodies[next_body])
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "socket_errors": %d, "non_2xx": %d, ' ..
    '"p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
