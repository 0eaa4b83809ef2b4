# kv-indexer container image.
#
#   docker build -t kv-indexer .                  # the indexer (default target)
#   docker build -t kv-indexer-mock --target mock .  # the mock engine (examples/mock_engine)
#   docker run -v $PWD/indexer.toml:/etc/kv-indexer/indexer.toml:ro -p 8090:8090 kv-indexer
#
# The configuration is not baked in: mount it at /etc/kv-indexer/indexer.toml (see docs.md).
# The HTTP API listens on 0.0.0.0:8090 inside the container (`--listen` overrides the file's
# `listen`, which usually says 127.0.0.1 for bare-metal use).

# ---- build: the zmq crate compiles libzmq from source with cc/g++, both in rust:1-bookworm.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin kv-indexer

# ---- mock-build: the simulated engine, only when the `mock` target is asked for.
FROM build AS mock-build
RUN cargo build --release --locked --example mock_engine

# ---- runtime-base: what both images run on.
# curl is there for HEALTHCHECK only: bookworm-slim has no HTTP client, and a dedicated check
# binary would be more code to keep than one small, well-known package. libstdc++ (for libzmq)
# is already part of bookworm-slim.
FROM debian:bookworm-slim AS runtime-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kv-indexer \
 && install -d -o kv-indexer -g kv-indexer -m 0700 /var/lib/kv-indexer
ENV RUST_LOG=info
USER kv-indexer

# ---- mock: publishes simulated KV events on every rank (see docker-compose.yml, profile mock).
FROM runtime-base AS mock
COPY --from=mock-build /src/target/release/examples/mock_engine /usr/local/bin/mock_engine
ENTRYPOINT ["/usr/local/bin/mock_engine"]
CMD ["--dp-size", "2", "--port", "5557", "--replay-port", "5600", "--recover-port", "8200", "--bind", "0.0.0.0"]

# ---- indexer (default): the last stage is what a plain `docker build` produces.
FROM runtime-base AS indexer
COPY --from=build /src/target/release/kv-indexer /usr/local/bin/kv-indexer
EXPOSE 8090
# /health answers as long as the HTTP server runs; readiness (every rank connected) is /ready.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["curl", "-fsS", "-o", "/dev/null", "http://127.0.0.1:8090/health"]
ENTRYPOINT ["/usr/local/bin/kv-indexer"]
CMD ["--config", "/etc/kv-indexer/indexer.toml", "--listen", "0.0.0.0:8090"]
