#!/usr/bin/env bash
# Installs what building Worldline needs on Debian 12 when it is missing: a C toolchain and a
# Rust toolchain (rustup: Debian's rustc is too old). Sourced by run-worker.sh and run-tests.sh.
set -euo pipefail

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing Debian packages: ${missing[*]}" >&2
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

if ! command -v cc >/dev/null 2>&1; then
  apt_install build-essential
fi

if ! command -v cargo >/dev/null 2>&1; then
  [ -x "$HOME/.cargo/bin/cargo" ] || {
    apt_install curl ca-certificates
    echo "installing Rust with rustup" >&2
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component rustfmt,clippy >&2
  }
  export PATH="$HOME/.cargo/bin:$PATH"
fi

# FFmpeg's libraries for the worker's default `media` feature (camera decoding, H.264 output,
# WebRTC): ffmpeg-sys-next finds them with pkg-config and generates its bindings with libclang.
# A machine without them (and without a package mirror) builds with WORLDLINE_NO_MEDIA=1 and
# `cargo build -p worker --no-default-features`.
if [ "${WORLDLINE_NO_MEDIA:-0}" != 1 ]; then
  apt_install pkg-config libclang-dev libavcodec-dev libavformat-dev libavutil-dev libswscale-dev
  # bindgen takes the newest libclang it finds, and libclang 22 (which comes with the clang-22
  # that compiles the kernels for gfx950 in CI) gives ffmpeg-sys-next's bindgen wrong struct
  # layouts: keep it on libclang-dev's, unless the caller chose one.
  if [ -z "${LIBCLANG_PATH:-}" ]; then
    # libclang-dev depends on libclang-N-dev, whose libclang.so is in /usr/lib/llvm-N/lib.
    llvm_major="$(dpkg-query -W -f='${Depends}' libclang-dev 2>/dev/null |
      sed -n 's/^libclang-\([0-9][0-9]*\)-dev.*/\1/p')"
    if [ -n "$llvm_major" ] && [ -e "/usr/lib/llvm-$llvm_major/lib/libclang.so" ]; then
      export LIBCLANG_PATH="/usr/lib/llvm-$llvm_major/lib"
    fi
  fi
fi
