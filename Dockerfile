# fencegate container image.
#
#   docker build -t fencegate:local .
#   docker run --rm -p 127.0.0.1:8080:8080 -p 127.0.0.1:9090:9090 \
#     -v "$PWD/my.toml:/etc/fencegate/fencegate.toml:ro" fencegate:local
#
# Builder and runtime are both Debian 12 (bookworm), so the binary links
# against the same glibc it runs on.

# ---------------------------------------------------------------- builder ---
FROM rust:1.95-bookworm AS builder

WORKDIR /build

# 1. Dependencies only: build them against stub targets so this layer is
#    reused until a manifest or Cargo.lock change.
#    The manifest names a bench target, so a stub of it must exist too; the
#    workspace's lock client crate gets a stub library.
COPY Cargo.toml Cargo.lock ./
COPY crates/fencegate-client/Cargo.toml ./crates/fencegate-client/
RUN mkdir src benches crates/fencegate-client/src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs crates/fencegate-client/src/lib.rs \
    && echo 'fn main() {}' > benches/hot_paths.rs \
    && cargo build --profile dist --locked \
    && rm -rf src crates/fencegate-client/src

# 2. The real sources. Migrations are embedded at compile time, so they are
#    needed here (and only here). The stub's own artifacts are removed so
#    cargo cannot mistake them for up to date (COPY keeps the files' mtimes).
COPY build.rs ./
COPY src ./src
COPY crates ./crates
COPY migrations ./migrations
# The OpenAPI document is compiled in (admin GET /openapi.json).
COPY docs/openapi.json ./docs/openapi.json
RUN rm -rf target/dist/.fingerprint/fencegate-* \
        target/dist/deps/fencegate-* \
        target/dist/deps/libfencegate-* \
        target/dist/deps/fencegate_client-* \
        target/dist/deps/libfencegate_client-* \
    && cargo build --profile dist --locked \
    && cp target/dist/fencegate /usr/local/bin/fencegate

# ---------------------------------------------------------------- runtime ---
FROM debian:bookworm-slim AS runtime

# curl: the HEALTHCHECK below (the binary has no health subcommand). Versions are deliberately not
# pinned: Debian only keeps the current security release of a package in
# the archive, so a pinned version would break the build after the next
# point release; the base image tag already fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/*

# Fixed, unprivileged uid/gid so volume ownership is predictable.
RUN groupadd --system --gid 10001 fencegate \
    && useradd --system --uid 10001 --gid fencegate \
        --home-dir /var/lib/fencegate --no-create-home \
        --shell /usr/sbin/nologin fencegate \
    && install -d -o fencegate -g fencegate -m 0750 /var/lib/fencegate

COPY --from=builder /usr/local/bin/fencegate /usr/local/bin/fencegate

# Default config (SQLite store "sqlite://fencegate.db", relative to the
# working directory). Mount your own over it, read-only:
#   -v ./config/docker.toml:/etc/fencegate/fencegate.toml:ro
COPY config/fencegate.toml /etc/fencegate/fencegate.toml

# Inside a container the listeners must bind all interfaces to be reachable
# through published ports. These variables override the config file's
# [server] listen / admin_listen; set them again with `-e` to change ports.
ENV FENCEGATE__SERVER__LISTEN=0.0.0.0:8080 \
    FENCEGATE__SERVER__ADMIN_LISTEN=0.0.0.0:9090

# The SQLite file (default store) lives here; mount a volume to keep it.
WORKDIR /var/lib/fencegate
VOLUME ["/var/lib/fencegate"]

USER 10001:10001

# 8080: proxied traffic and the lock API. 9090: metrics, health, admin API.
EXPOSE 8080 9090

HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["curl", "--fail", "--silent", "--show-error", "--output", "/dev/null", "http://127.0.0.1:9090/healthz"]

# SIGTERM (docker stop) triggers the graceful drain.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fencegate"]
CMD ["serve", "--config", "/etc/fencegate/fencegate.toml"]
