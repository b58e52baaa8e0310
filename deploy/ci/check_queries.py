#!/usr/bin/env python3
"""Every PromQL expression of the rules and the Grafana dashboard returns data from a live
Prometheus that scrapes a worker under load.

Usage: check_queries.py PROMETHEUS_URL RULE_FILE... --dashboard DASHBOARD_JSON

- Recording rules: the expression returns at least one sample with a finite value, and the
  recorded series exists.
- Alert rules: the expression is `<lhs> <comparison> <rhs>`; when the alert is not firing the
  whole expression is empty by design, so then both sides must return data.
- Every rule's last evaluation is healthy (no error) per /api/v1/rules.
- Dashboard: each target's expression, with Grafana's variables substituted ($instance and
  $model match all, $__rate_interval is 1m, $__range 5m), returns data; `label_values(sel, l)`
  variable queries return series carrying label l.

Prints one line per expression and exits 1 naming every empty one.
"""

import argparse
import json
import math
import re
import sys
import urllib.parse
import urllib.request

import yaml

SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "${datasource}": "",
}
ALL_VALUES = ".*"


def query(base, expr):
    url = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"query failed: {body}")
    return body["data"]


def finite_samples(data):
    """Samples of an instant query's result with finite values."""
    kind, result = data["resultType"], data["result"]
    if kind == "scalar":
        result = [{"metric": {}, "value": result}]
    if kind not in ("vector", "scalar"):
        return []
    return [r for r in result if math.isfinite(float(r["value"][1]))]


def split_comparison(expr):
    """(lhs, op, rhs) at the last comparison outside brackets, quotes and `by (...)` lists."""
    depth, quote, last = 0, None, None
    i = 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            for op in ("==", "!=", ">=", "<=", ">", "<"):
                if expr.startswith(op, i):
                    last = (i, op)
                    i += len(op) - 1
                    break
        i += 1
    if last is None:
        return None
    at, op = last
    rhs = expr[at + len(op):].strip()
    # Drop a `bool` modifier and an `on (...)`/`ignoring (...)` matcher of the comparison.
    rhs = re.sub(r"^(bool\s+)?((on|ignoring)\s*\([^)]*\)\s*)?(group_(left|right)\s*(\([^)]*\))?\s*)?", "", rhs)
    return expr[:at].strip(), op, rhs


def substitute(expr):
    for k, v in SUBSTITUTIONS.items():
        expr = expr.replace(k, v)
    # Any other variable (a multi-value template such as $instance, ${model}) matches all.
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ALL_VALUES, expr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prometheus")
    ap.add_argument("rules", nargs="*")
    ap.add_argument("--dashboard", action="append", default=[])
    args = ap.parse_args()
    base = args.prometheus
    empty, checked = [], 0

    def check(label, expr):
        nonlocal checked
        checked += 1
        samples = finite_samples(query(base, expr))
        print(f"  {'ok ' if samples else 'EMPTY'} {label}: {len(samples)} series")
        if not samples:
            empty.append(f"{label}: {expr}")
        return bool(samples)

    for path in args.rules:
        with open(path) as f:
            doc = yaml.safe_load(f)
        for group in doc.get("groups", []):
            for rule in group.get("rules", []):
                expr = " ".join(rule["expr"].split())
                if "record" in rule:
                    check(f"{path}: record {rule['record']}", expr)
                    check(f"{path}: series {rule['record']}", rule["record"])
                    continue
                name = f"{path}: alert {rule['alert']}"
                checked += 1
                if finite_samples(query(base, expr)):
                    print(f"  ok  {name}: firing")
                    continue
                parts = split_comparison(expr)
                if parts is None:
                    print(f"  EMPTY {name}: not firing and not of the form lhs <op> rhs")
                    empty.append(f"{name}: {expr}")
                    continue
                lhs, op, rhs = parts
                print(f"  ok  {name}: not firing; its sides:")
                check(f"{name} (left of {op})", lhs)
                if not re.fullmatch(r"[0-9.eE+-]+", rhs):
                    check(f"{name} (right of {op})", rhs)

    with urllib.request.urlopen(base.rstrip("/") + "/api/v1/rules", timeout=30) as r:
        rules = json.load(r)["data"]["groups"]
    for g in rules:
        for rule in g["rules"]:
            checked += 1
            if rule.get("health") != "ok":
                print(f"  BAD rule {rule['name']}: health {rule.get('health')} {rule.get('lastError', '')}")
                empty.append(f"rule {rule['name']} is unhealthy: {rule.get('lastError', '')}")

    for path in args.dashboard:
        with open(path) as f:
            dash = json.load(f)
        for var in dash.get("templating", {}).get("list", []):
            q = var.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q or "")
            if var.get("type") != "query" or not m:
                continue
            checked += 1
            sel, label = substitute(m.group(1)), m.group(2)
            got = [r for r in finite_samples(query(base, sel)) if label in r["metric"]]
            print(f"  {'ok ' if got else 'EMPTY'} {path}: variable ${var['name']}: {len(got)} series with {label}")
            if not got:
                empty.append(f"{path}: variable {var['name']}: {q}")
        for panel in dash.get("panels", []):
            for t in panel.get("targets", []):
                check(f"{path}: '{panel['title']}' {t.get('refId')}", substitute(t["expr"]))

    if empty:
        print(f"{len(empty)} expression(s) returned no data:", file=sys.stderr)
        for e in empty:
            print(f"  {e}", file=sys.stderr)
        sys.exit(1)
    print(f"all {checked} expressions and rules returned data")


if __name__ == "__main__":
    main()
