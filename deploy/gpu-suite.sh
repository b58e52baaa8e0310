#!/usr/bin/env bash
# The GPU checks and benchmarks of the issues, in one call on a GPU machine.
#
#   deploy/gpu-suite.sh stage            # here: build and strip what the GPU machine runs
#   deploy/gpu-suite.sh run [parts...]   # there: run it, logs and JSON under $OUT (or ./gpu-out)
#
# `stage` builds the worker without FFmpeg (the GPU host lacks it) and every test binary that has
# GPU checks, and copies them, stripped, into target/gpu-suite/ (carry that folder). `run` goes
# through the parts in order, each under its own time limit, and prints one summary line per part
# at the end; a part that fails or times out does not stop the others. Parts (default: all that
# the machine can run): tests, kernels, codecs, sp (tests1 / tests2: only the one- / two-GPU
# tests; quick: the tests of the ops, the DiT and the codecs; ops: the ops, fp8 linears and the DiT; text: the umT5 prompt encode and
# its peer; codecs-bf16: the bf16 video codecs and their peer, with the convolution choices;
# chunks: whole chunks of lingbot-14b and -1.3b on one card, fp8 linears and bf16; vsa: the VSA
# tests and `bench vsa`; vsa-bench: `bench vsa` alone; bytes-vsa: Nsight Compute's count of the fine kernel's bytes from L2, default and `persist`; source-vsa: its warp samples per instruction, default and `persist`; means-vsa: the means kernels' time and DRAM bytes under Nsight Compute; sparse: `--attention vsa` in the model, its GPU tests and 14B chunks with
# and without it (sparse-tests / sparse-chunks: one half); sparse4: those chunks at `--chunk-frames 4` (LingBot v2's loop); profile-vsa: Nsight Compute over the VSA prefix kernels, where the machine
# has ncu; gemm-algos: the kernels table's GEMMs with each of cuBLASLt's first eight heuristic
# answers; gemm-configs: those GEMMs with other configurations of the heuristic's algorithm;
# blocks: the kernels table's DiT block rows and their PyTorch peers alone (the fp8 block with and
# without WORLDLINE_DEFER_BIAS among them), with the q/k norm + RoPE rows and the norm rows at
# lingbot-1.3b's width; deferred: that switch's GPU tests alone (its kernels
# against the CPU, and the fp8 stream with it); serve: `worker serve`'s start-up chunk and /status;
# rocm: on an AMD machine, the ops and DiT tests on rocm:0 and the kernels table with its
# peer). `sp` needs two GPUs; the PyTorch peers need the machine's python3 with torch. Beside
# summary.txt, everything the run wrote ends up in one archive, suite.tgz: the device tool brings
# back only a few files from $OUT.
# GPU_SUITE_SECONDS caps the whole run: each part's limit shrinks to what is left, and a part with
# under 20 s left is skipped and said so, so the summary still comes out inside one device call.
# GPU_SUITE_CARD (e.g. H200) runs nothing and exits 3 unless the first GPU's name contains it: a
# call that may come up on another card then costs only its start.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=target/gpu-suite
# The longest last, so that a run cut short by GPU_SUITE_SECONDS has covered the others.
tests1=(kernels:vsa pipeline:gpu pipeline:gpu_codecs pipeline:fp8_linears kernels:backend_consistency)
tests2=(pipeline:gpu_sequence_parallel sp:nccl)
tests=("${tests1[@]}" "${tests2[@]}")
quick=(kernels:backend_consistency pipeline:gpu pipeline:gpu_codecs)
ops=(kernels:backend_consistency pipeline:fp8_linears pipeline:gpu)

stage() {
  set -e
  cargo build --release -p worker --no-default-features
  rm -rf "$dir" && mkdir -p "$dir"
  cp target/release/worker "$dir/"
  for t in "${tests[@]}"; do
    local crate=${t%%:*} name=${t#*:}
    # The executable's path is in cargo's JSON messages.
    local exe
    exe=$(cargo test --no-run -p "$crate" --test "$name" --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
    [ -n "$exe" ] || { echo "no executable for $t" >&2; exit 1; }
    cp "$exe" "$dir/$name"
  done
  strip "$dir"/* 2>/dev/null || true
  du -sh "$dir"
}

summary=()
part() { # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then
    summary+=("$(printf '%-28s skipped: %ss left of GPU_SUITE_SECONDS' "$name" "$left")")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  local t0=$SECONDS
  # When each part ran, to line up with a power or clock trace taken beside the suite.
  echo "$(date -u +%T.%N | cut -c1-12) start $name" >>"$out/parts.txt"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$(date -u +%T.%N | cut -c1-12) end $name rc $rc" >>"$out/parts.txt"
  # The test result line (with how many checks skipped for want of a device), else the last line.
  local said skipped
  said=$(grep -E '^test result' "$out/$name.log" | tail -1)
  [ -n "$said" ] || said=$(grep -m1 -E '^Error|^error' "$out/$name.log")
  [ -n "$said" ] || said=$(grep -v '^\s*$' "$out/$name.log" | tail -1)
  skipped=$(grep -ciE 'skipping|skipped' "$out/$name.log")
  [ "$skipped" = 0 ] || said="$said [$skipped skipped]"
  summary+=("$(printf '%-28s rc %-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "${said:0:110}")")
}

run() {
  if [ -n "${GPU_SUITE_CARD:-}" ]; then
    local card
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    if [[ "$card" != *"$GPU_SUITE_CARD"* ]]; then
      echo "GPU_SUITE_CARD=$GPU_SUITE_CARD: this machine's card is '${card:-none}'; nothing run" >&2
      exit 3
    fi
  fi
  out=${OUT:-gpu-out}
  deadline=$((SECONDS + ${GPU_SUITE_SECONDS:-86400}))
  mkdir -p "$out"
  export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export WORLDLINE_KERNEL_CACHE=${WORLDLINE_KERNEL_CACHE:-/tmp/worldline-kernels}
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  # cuDNN for the convolutions where it measures faster: the PyTorch wheel's copy.
  local cudnn
  cudnn=$(python3 -c 'import os, nvidia.cudnn as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
  if [ -n "$cudnn" ] && [ -d "$cudnn" ]; then
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$cudnn WORLDLINE_REQUIRE_CUDNN=${WORLDLINE_REQUIRE_CUDNN:-1}
  fi
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  # Nsight Compute, for the profiling parts (empty where the machine has none).
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  local parts=("$@")
  [ ${#parts[@]} -gt 0 ] || parts=(tests kernels codecs sp)
  # Power, clock and throttle reasons every 100 ms beside the whole run: the benches print each
  # sustained window on the wall clock, and worker/bench/power.py joins the two (watts, MHz and
  # joules a call). `power.draw` is a moving average over about a second.
  local trace=
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,index,power.draw,clocks.sm,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv,noheader -lms 100 >"$out/power.csv" 2>&1 &
    trace=$!
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv >"$out/gpus.csv" 2>&1
  for p in "${parts[@]}"; do
    case $p in
    tests | tests1 | tests2 | quick | ops)
      local -n list=$p
      for t in "${list[@]}"; do
        local name=${t#*:}
        part "test-$name" 300 "$dir/$name" --test-threads=1 --nocapture
      done
      ;;
    rocm)
      # An AMD machine (never lent so far): the ops and the DiT against the CPU on rocm:0 (the
      # test binaries' `::rocm` cases; the CUDA ones skip), then the kernels table beside the same
      # PyTorch peer (a ROCm torch answers to torch.cuda).
      rocm-smi --showproductname --showdriverversion >"$out/rocm-smi.txt" 2>&1
      for t in "${ops[@]}"; do
        part "rocm-test-${t#*:}" 600 "$dir/${t#*:}" --test-threads=1 --nocapture
      done
      part rocm-bench-kernels 600 "$dir/worker" bench kernels --device rocm --repeat 3 --json "$out/kernels-rocm.json"
      part rocm-peer-kernels 300 python3 worker/bench/peer.py "$out/peer-rocm.json"
      ;;
    deferred)
      part test-deferred-ops 200 "$dir/backend_consistency" biases deferred --test-threads=1 --nocapture
      part test-deferred-stream 300 "$dir/fp8_linears" deferred --test-threads=1 --nocapture
      ;;
    kernels)
      part bench-kernels 300 "$dir/worker" bench kernels --device cuda --repeat 3 --json "$out/kernels.json"
      part peer-kernels 200 python3 worker/bench/peer.py "$out/peer.json"
      ;;
    serve)
      # `worker serve` on the GPU: its start-up chunk (kernels compiled, GEMM plans tuned) before
      # the port opens, then /status (warm_up_seconds) and the start log.
      part serve-warm-up 300 bash -c '
        "$0" --model lingbot-1.3b --weights random --device cuda --dtype fp8 \
          --listen 127.0.0.1:8791 >"$1/serve.log" 2>&1 & pid=$!
        python3 - <<PY
import json, time, urllib.request
for _ in range(280):
    try:
        s = json.load(urllib.request.urlopen("http://127.0.0.1:8791/status", timeout=2))
        print(json.dumps({k: s.get(k) for k in ("model", "device", "dtype", "warm_up_seconds", "sessions")}))
        break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit("no /status within 280 s")
PY
        rc=$?; kill $pid; wait $pid; grep -E "warmed up|tuned|compiled" "$1/serve.log" | cut -c1-300; exit $rc' "$dir/worker" "$out"
      ;;
    blocks)
      # The DiT block rows of `kernels` alone, ours and PyTorch's: a block's change in a short call.
      part bench-blocks 200 "$dir/worker" bench blocks --device cuda --json "$out/blocks.json"
      part peer-blocks 200 python3 worker/bench/peer.py "$out/peer-blocks.json" --blocks
      ;;
    gemm-algos)
      part bench-gemm-algos 200 "$dir/worker" bench gemm-algos --device cuda --json "$out/gemm-algos.json"
      ;;
    gemm-configs)
      part bench-gemm-configs 300 "$dir/worker" bench gemm-configs --device cuda --json "$out/gemm-configs.json"
      ;;
    codecs)
      part bench-codecs 300 "$dir/worker" bench codecs --device cuda --repeat 3 --json "$out/codecs.json"
      part peer-codecs 300 python3 worker/bench/codecs_peer.py "$out/codecs_peer.json"
      ;;
    text)
      part bench-text 200 "$dir/worker" bench codecs --device cuda --codecs text --repeat 3 --json "$out/text.json"
      part peer-text 200 python3 worker/bench/codecs_peer.py "$out/text_peer.json" --only text --repeat 3
      ;;
    codecs-bf16)
      part bench-codecs-bf16 300 "$dir/worker" bench codecs --device cuda --repeat 3 --codec-dtypes bf16 \
        --codecs tiny-dec,tiny-enc,vae-dec,vae-enc --json "$out/codecs.json"
      cp "$WORLDLINE_KERNEL_CACHE"/convs-*.tsv "$out/" 2>/dev/null
      part peer-codecs 300 python3 worker/bench/codecs_peer.py "$out/codecs_peer.json" --only coders
      ;;
    sp)
      if [ "$gpus" -ge 2 ]; then
        part bench-sp-14b 400 "$dir/worker" bench sp --model lingbot-14b --device cuda --cards 2 \
          --dtype bf16 --chunks 5 --json "$out/sp14.json"
        part bench-sp-1.3b 200 "$dir/worker" bench sp --model lingbot-1.3b --device cuda --cards 2 \
          --dtype bf16 --chunks 5 --json "$out/sp13.json"
      else
        summary+=("sp: skipped, $gpus GPU(s) here (needs 2)")
      fi
      ;;
    vsa)
      part test-backend_consistency-vsa 200 "$dir/backend_consistency" vsa --test-threads=1 --nocapture
      part test-vsa 100 "$dir/vsa" --test-threads=1 --nocapture
      ;&
    vsa-bench)
      # `bench vsa` (alone: the VSA rows of a build whose kernels the tests already passed).
      part bench-vsa 300 "$dir/worker" bench vsa --device cuda --repeat 3 --json "$out/vsa.json"
      ;;
    profile-vsa)
      # The tile means, the coarse kernel and the fine kernel of the first VSA call (ncu holds the
      # SM clock lower, so its durations read longer than the bench's). Every ncu run here ends
      # the bench once its kernels are profiled (`--kill yes`; without it ncu reports only after
      # the whole bench, ~160 s on an H200), so its rc is the kill's, not a failure.
      if [ -n "$ncu" ]; then
        local sections=(--section SpeedOfLight --section SchedulerStats --section WarpStateStats
          --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis)
        part ncu-vsa 300 "$ncu" --kill yes -k 'regex:vsa_coarse|vsa_tile_means|vsa_fine_tma' -c 3 "${sections[@]}" \
          "$dir/worker" bench vsa --device cuda --repeat 1
        # Why a fine step waits, beside the dense kernel's: each stall reason per issued
        # instruction and the tensor path's bf16 ops against its peak (sm__pipe_tensor_op_gmma_cycles_active
        # answered n/a on 2026-12-05), for the first call of each.
        local stalls=(--metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__ops_path_tensor_src_bf16_dst_fp32.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,sm__cycles_elapsed.max')
        part ncu-stalls-dense 200 "$ncu" --kill yes -k 'regex:flash_tma' -c 1 "${stalls[@]}" \
          "$dir/worker" bench vsa --device cuda --repeat 1
        part ncu-stalls-vsa 200 "$ncu" --kill yes -k 'regex:vsa_fine_tma' -c 1 "${stalls[@]}" \
          "$dir/worker" bench vsa --device cuda --repeat 1
      else
        summary+=("profile-vsa: skipped, no ncu here")
      fi
      ;;
    source-vsa)
      # Where the fine kernel's warps wait, instruction by instruction: Nsight Compute's warp
      # sampling (SourceCounters) over the first fine kernel of `bench vsa`, the default kernel
      # (`exact`) and `persist` (whole boxes), then the instructions with the most samples from
      # its source page (kept as gzipped CSV; the report itself is dropped). VSA_SOURCE_KERNELS
      # names other fine kernels (values of WORLDLINE_VSA_FINE) to sample instead.
      if [ -n "$ncu" ]; then
        local f
        for f in ${VSA_SOURCE_KERNELS:-exact persist}; do
          part "ncu-source-$f" 200 env WORLDLINE_VSA_FINE=$f "$ncu" --kill yes -k 'regex:vsa_fine_tma' -c 1 \
            --section SourceCounters --section WarpStateStats -f -o "$out/source-$f" \
            "$dir/worker" bench vsa --device cuda --repeat 1
          part "source-top-$f" 60 bash -c '"$1" --import "$2.ncu-rep" --page source --csv --print-source sass >"$2.csv" &&
            python3 deploy/ncu-source-top.py "$2.csv" 25; gzip -f "$2.csv"; rm -f "$2.ncu-rep"' _ "$ncu" "$out/source-$f"
        done
      else
        summary+=("source-vsa: skipped, no ncu here")
      fi
      ;;
    bytes-vsa)
      # The bytes the SMs read from L2 in the first fine kernel of `bench vsa`, with the default
      # kernel (the window's edge tiles in boxes of their own size) and with `persist` (every
      # tile in a whole box), at full clock; each ends the bench once it is profiled (see
      # profile-vsa).
      if [ -n "$ncu" ]; then
        local bytes=(--kill yes --clock-control none -k 'regex:vsa_fine_tma' -c 1 --metrics
          'l1tex__m_xbar2l1tex_read_bytes.sum,lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,gpu__time_duration.sum')
        part ncu-bytes-default 200 "$ncu" "${bytes[@]}" "$dir/worker" bench vsa --device cuda --repeat 1
        part ncu-bytes-persist 200 env WORLDLINE_VSA_FINE=persist "$ncu" "${bytes[@]}" \
          "$dir/worker" bench vsa --device cuda --repeat 1
      else
        summary+=("bytes-vsa: skipped, no ncu here")
      fi
      ;;
    means-vsa)
      # The VSA means kernels at full clock, the first twelve launches of `bench vsa` (the
      # window's and then the chunk's frame sums, the query means with the key means from the
      # sums; the grid size tells them apart): the time, DRAM bytes and throughput of each say
      # how far these memory-bound kernels are from the copy ceiling.
      if [ -n "$ncu" ]; then
        part ncu-means 200 "$ncu" --kill yes --clock-control none -k 'regex:vsa_frame_sums|vsa_means_from_sums' \
          -c 12 --metrics 'gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread' \
          "$dir/worker" bench vsa --device cuda --repeat 1
      else
        summary+=("means-vsa: skipped, no ncu here")
      fi
      ;;
    sparse | sparse-tests)
      # `--attention vsa` in the model: its GPU tests against the CPU (sparse-tests: those
      # alone), then whole 14B chunks with it and without it, fp8 linears both (the sparse/dense
      # ratio a stream sees).
      part test-gpu-sparse 300 "$dir/gpu" sparse --test-threads=1 --nocapture
      [ "$p" = sparse ] || continue
      ;&
    sparse-chunks)
      for a in vsa bf16; do
        part "chunks-14b-fp8-$a" 200 "$dir/worker" bench sp --model lingbot-14b --device cuda --cards 1 \
          --dtype fp8 --attention "$a" --chunks 3 --json "$out/chunks-14b-fp8-$a.json"
      done
      ;;
    sparse4)
      # The same chunks in LingBot v2's loop (chunks of 4 latent frames), where every query tile
      # is full in time.
      for a in vsa bf16; do
        part "chunks4-14b-fp8-$a" 200 "$dir/worker" bench sp --model lingbot-14b --device cuda --cards 1 \
          --dtype fp8 --attention "$a" --chunk-frames 4 --chunks 3 --json "$out/chunks4-14b-fp8-$a.json"
      done
      ;;
    chunks)
      for m in lingbot-14b lingbot-1.3b; do
        for d in fp8 bf16; do
          part "chunks-$m-$d" 200 "$dir/worker" bench sp --model "$m" --device cuda --cards 1 \
            --dtype "$d" --chunks 3 --json "$out/chunks-$m-$d.json"
        done
      done
      ;;
    *) echo "unknown part $p (tests, tests1, tests2, quick, ops, kernels, gemm-algos, gemm-configs, vsa, sparse, sparse4, profile-vsa, codecs, codecs-bf16, text, sp, chunks, rocm, vsa-bench, bytes-vsa, source-vsa, means-vsa, sparse-tests, sparse-chunks)" >&2 ;;
    esac
  done
  if [ -n "$trace" ]; then
    kill "$trace" 2>/dev/null
    python3 worker/bench/power.py "$out/power.csv" "$out"/*.log >"$out/power.txt" 2>&1
  fi
  printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
  # Everything else in one archive beside the summary: the device tool brings back only the
  # first few files of $OUT in name order.
  local list tgz
  list=$(mktemp) tgz=$(mktemp)
  (cd "$out" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt -printf '%P\n' | sort >"$list" &&
    [ -s "$list" ] && tar czf "$tgz" -T "$list" && xargs -d '\n' rm -rf <"$list" && mv "$tgz" suite.tgz)
  rm -f "$list" "$tgz"
}

case ${1:-} in
stage) stage ;;
run) shift && run "$@" ;;
*) sed -n '2,19p' "$0" && exit 2 ;;
esac
