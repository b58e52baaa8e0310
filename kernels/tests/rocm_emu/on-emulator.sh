#!/usr/bin/env bash
# Runs a command with the ROCm backend pointed at the CPU emulation of a wave64 GPU (this folder),
# as rocm_emulated.rs does for its own tests, so that any test with a `::rocm` case runs there
# without an AMD card, e.g.
#
#   kernels/tests/rocm_emu/on-emulator.sh gfx942 \
#     cargo test -p kernels --test backend_consistency -- biases_in_the_norms_match_the_cpu::rocm
#
# What passing proves (launch shapes, arguments, strides, wave64 logic; nothing about AMD's
# compiler, hardware or hipBLASLt's kernels) is in the README. The emulator runs a block as a team
# of threads: shapes of the 14B model take minutes an op.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 gfx942|gfx950 command..." >&2; exit 2; }
arch=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
cxx=${WORLDLINE_ROCM_EMU_CXX:-clang++-19}
out="$here/../../../target/tmp/rocm-emu-$arch"
mkdir -p "$out"
lib="$out/libwl_rocm_emu.so"
if [ ! -e "$lib" ] || [ "$here/runtime.cpp" -nt "$lib" ]; then
  "$cxx" -std=c++20 -O2 -fPIC -shared "$here/runtime.cpp" -o "$lib" -ldl -lpthread
fi
# The compiled units depend on emu.h, which the backend's cache key does not see: a cache per emu.h.
tag=$(sha256sum "$here/emu.h" | cut -c1-16)
export WORLDLINE_ROCM_LIBRARY="$lib" WORLDLINE_ROCM_EMU_DIR="$here" WORLDLINE_ROCM_EMU_CXX="$cxx"
export WORLDLINE_ROCM_ARCH="$arch" WORLDLINE_KERNEL_CACHE="$out/cache-sh-$tag" WORLDLINE_POISON=1
# One test at a time: the emulator keeps a kernel's __shared__ variables as statics (emu.h), so
# two launches at once from two test threads would share them (seen: a residual norm test failed
# beside another and passed alone).
export RUST_TEST_THREADS=1
exec "$@"
