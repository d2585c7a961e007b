# syntax=docker/dockerfile:1
# tenured in a container. Build from the repository root:
#   docker build -t tenured .
# Run (see README.md "Running as a service" for why the listen address is set by hand):
#   docker run -d --name tenured -e TENURE_LISTEN=0.0.0.0:7878 \
#     -p 127.0.0.1:7878:7878 -v tenure-data:/var/lib/tenure tenured

# ---- build: the workspace's MSRV toolchain, on the same Debian release as the runtime so the
# binary's glibc matches.
FROM rust:1.89-slim-bookworm AS builder
WORKDIR /src
COPY . .
# The caches keep crates.io downloads and compiled dependencies between builds; the binary is
# copied out of the cached target directory, which is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p tenure-server --bin tenured \
    && install -m 0755 target/release/tenured /usr/local/bin/tenured

# ---- runtime: the binary, the sample config and an unprivileged user.
FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/tenure \
        --shell /usr/sbin/nologin tenure \
    && install -d -o tenure -g tenure -m 0700 /var/lib/tenure
COPY --from=builder /usr/local/bin/tenured /usr/local/bin/tenured
COPY server/deploy/tenured.toml /etc/tenure/tenured.toml
# The sample config listens on 127.0.0.1, which is unreachable from outside the container. It
# is not changed to 0.0.0.0 here on purpose: tenured has no authentication yet, so anything that
# can reach the port can take or release any lock. Opt in with TENURE_LISTEN=0.0.0.0:7878 and
# publish the port only on a trusted address (-p 127.0.0.1:7878:7878).
USER tenure
EXPOSE 7878
VOLUME ["/var/lib/tenure"]
# SIGTERM (docker stop) drains connections for 5 s and syncs the WAL, inside docker's 10 s.
ENTRYPOINT ["/usr/local/bin/tenured", "--config", "/etc/tenure/tenured.toml"]
