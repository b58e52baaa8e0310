#!/usr/bin/env bash
# Overhead and latency: tiny on CPU, WS and WebRTC, 1 and 2 sessions; per run a fresh worker.
set -u
BIN=${BIN:-target/debug}
OUT=/tmp/media_bench; mkdir -p $OUT
port=18431
for transport in ws webrtc; do
  for n in 1 2; do
    extra=""; [ "$transport" = webrtc ] && extra="--ice-loopback"
    $BIN/worker serve --model tiny --listen 127.0.0.1:$port --max-sessions 2 $extra ${RES:-} > $OUT/worker_${transport}_$n.log 2>&1 &
    wpid=$!
    for i in $(seq 1 100); do curl -s 127.0.0.1:$port/healthz >/dev/null && break; sleep 0.2; done
    codec=""; [ "$transport" = ws ] && codec="--camera-codec h264"
    url="ws://127.0.0.1:$port/v1/ws?output=h264"; [ "$transport" = webrtc ] && url="http://127.0.0.1:$port/v1/webrtc/offer"
    $BIN/loadgen --transport $transport --url "$url" --sessions $n --seconds ${SECS:-12} --camera $codec --json $OUT/${transport}_$n.json > $OUT/${transport}_$n.txt 2>&1
    sleep 1
    curl -s 127.0.0.1:$port/metrics > $OUT/metrics_${transport}_$n.txt
    kill $wpid; wait $wpid 2>/dev/null
    port=$((port+1))
  done
done
