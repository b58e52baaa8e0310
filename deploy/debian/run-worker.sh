#!/usr/bin/env bash
# Builds the worker (release) and runs it; arguments go to `worker` (try --help).
# With none, it serves the `tiny` model on the best device present at http://127.0.0.1:8080/.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
source deploy/debian/prereqs.sh
if [ "${WORLDLINE_NO_MEDIA:-0}" = 1 ]; then
  cargo build --release -p worker --no-default-features # no FFmpeg: WebSocket JPEG sessions only
else
  cargo build --release -p worker
fi
exec ./target/release/worker "$@"
