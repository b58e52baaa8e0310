#!/usr/bin/env bash
# Builds the worker (release) and runs it; arguments go to `worker` (try --help).
# With none, it serves the `tiny` model on the best device present at http://127.0.0.1:8080/.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
source deploy/debian/prereqs.sh
cargo build --release -p worker
exec ./target/release/worker "$@"
