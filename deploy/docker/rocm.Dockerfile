# syntax=docker/dockerfile:1
# The worker for AMD Instinct GPUs (MI300X, MI355X). From the repository root:
#   docker build -f deploy/docker/rocm.Dockerfile -t worldline/worker-rocm:0.1.0 .
#   docker run --device /dev/kfd --device /dev/dri --group-add video -p 8080:8080 \
#     -v worldline-cache:/cache -v /models:/weights:ro worldline/worker-rocm:0.1.0
# The worker loads HIP, hipRTC, hipBLASLt and RCCL at run time; the runtime image carries them.
# Unrun: the ROCm backend is built but has never run on an AMD GPU (`/status` says so), and this
# image has never been built (the project's machines have no container runtime).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p worker \
    && install -D target/release/worker /out/worker

# Ubuntu 24.04 (glibc 2.39, newer than the build stage's 2.36) with the ROCm 6.4 runtime.
FROM rocm/dev-ubuntu-24.04:6.4.1
# curl serves the HEALTHCHECK; the base image's Ubuntu release pins its version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 worldline \
    && useradd --system --uid 10001 --gid worldline --groups video,render \
       --create-home --home-dir /home/worldline worldline \
    && mkdir -p /cache /weights \
    && chown worldline:worldline /cache /weights
COPY --from=build /out/worker /usr/local/bin/worker
USER 10001:10001
ENV WORLDLINE_KERNEL_CACHE=/cache/kernels \
    WORLDLINE_NCCL_LIBRARY=librccl.so.1
VOLUME ["/cache", "/weights"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8080/healthz"]
ENTRYPOINT ["/usr/local/bin/worker"]
CMD ["serve", "--listen", "0.0.0.0:8080"]
