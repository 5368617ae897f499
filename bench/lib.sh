# Sourced by bench/run.sh and bench/profile.sh: both measure fencegate on
# the same routes, so a profile explains the numbers the benchmark gives.

# The [[routes]] of a measured fencegate, to the upstream on port $1.
fg_routes() { # upstream port
    cat <<ROUTES
[[routes]]
name = "documents"
path = "/docs/{id}"
upstream = "http://127.0.0.1:$1"
key = "doc:{id}"

# (h) and (i): the same resources, with an Idempotency-Key on every write.
[[routes]]
name = "keyed"
path = "/keyed/{id}"
upstream = "http://127.0.0.1:$1"
key = "doc:{id}"
idempotency = "required"
ROUTES
}
