# syntax=docker/dockerfile:1
# The worker for NVIDIA GPUs. From the repository root:
#   docker build -f deploy/docker/cuda.Dockerfile -t worldline/worker-cuda:0.1.0 .
#   docker run --gpus all -p 8080:8080 -v worldline-cache:/cache -v /models:/weights:ro \
#     worldline/worker-cuda:0.1.0 serve --listen 0.0.0.0:8080 --device cuda --model lingbot-1.3b --weights /weights/lingbot-1.3b
# No GPU toolchain is needed to build: the worker loads the CUDA driver, NVRTC, cuBLASLt and NCCL
# at run time, and the runtime image below carries them. The browser client is compiled into
# the binary. Never built on the project's machines (they have no container runtime).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p worker \
    && install -D target/release/worker /out/worker

# Ubuntu 24.04: glibc 2.39, newer than the build stage's 2.36.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
# curl serves the HEALTHCHECK; the base image's Ubuntu release pins its version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 worldline \
    && useradd --system --uid 10001 --gid worldline --create-home --home-dir /home/worldline worldline \
    && mkdir -p /cache /weights \
    && chown worldline:worldline /cache /weights
COPY --from=build /out/worker /usr/local/bin/worker
USER 10001:10001
# Compiled kernels (keyed by source, arch and compiler) survive restarts on this volume.
ENV WORLDLINE_KERNEL_CACHE=/cache/kernels
VOLUME ["/cache", "/weights"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8080/healthz"]
ENTRYPOINT ["/usr/local/bin/worker"]
CMD ["serve", "--listen", "0.0.0.0:8080", "--device", "cuda"]
