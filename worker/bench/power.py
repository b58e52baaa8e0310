"""Joins the benches' sustained windows with an nvidia-smi trace: the card's power, clock and
throttle reasons while each sustained row ran, and the energy of one call.

    python3 worker/bench/power.py power.csv bench-blocks.log peer-blocks.log ...

The trace is what deploy/gpu-suite.sh records beside a run (`nvidia-smi
--query-gpu=timestamp,index,power.draw,clocks.sm,temperature.gpu,clocks_throttle_reasons.active
--format=csv,noheader -lms 100`; traces without the index column are read too). The logs are
those of `worker bench` and peer.py, whose sustained rows print

    sustained window: unix START to END, N calls, MS ms a call

`power.draw` is a moving average over about a second, so a window's power is taken over its
last 0.8 s (its calls run for 2 s), summed over the cards of a sample. Held back to back at the
card's power cap, a sustained time is set by the energy a call takes: that is the J column.
"""

import csv
import datetime
import re
import sys

WINDOW = re.compile(r"sustained window: unix ([\d.]+) to ([\d.]+)(?:, (\d+) calls, ([\d.]+) ms a call)?")
TAIL_S = 0.8


def read_trace(path):
    """[(unix seconds, watts summed over the cards, SM MHz of the first card, reasons)], by time."""
    by_time = {}
    with open(path, newline="") as f:
        for row in csv.reader(f):
            row = [c.strip() for c in row]
            if len(row) == 6:
                stamp, _, watts, mhz, _, reasons = row
            elif len(row) == 5:
                stamp, watts, mhz, _, reasons = row
            else:
                continue
            try:
                t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f")
                w, c = float(watts.split()[0]), float(mhz.split()[0])
                r = int(reasons, 16)
            except ValueError:
                continue  # a header, an error line, or [N/A]
            t = t.replace(tzinfo=datetime.timezone.utc).timestamp()
            if t in by_time:
                w0, c0, r0 = by_time[t]
                by_time[t] = (w0 + w, c0, r0 | r)
            else:
                by_time[t] = (w, c, r)
    return sorted((t, w, c, r) for t, (w, c, r) in by_time.items())


def windows(path):
    """[(start, end, ms a call or None, the next line that is not a window)]."""
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = WINDOW.search(line)
        if not m:
            continue
        after = next((x for x in lines[i + 1:] if not WINDOW.search(x) and x.strip()), "")
        ms = float(m.group(4)) if m.group(4) else None
        out.append((float(m.group(1)), float(m.group(2)), ms, after))
    return out


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    trace = read_trace(argv[1])
    if not trace:
        sys.exit(f"{argv[1]}: no samples")
    print(f"{'log':<18} {'window (UTC)':<13} {'W':>5} {'MHz':>5} {'reasons':>8} {'ms a call':>10} {'J a call':>9}  next line")
    for path in argv[2:]:
        for start, end, ms, after in windows(path):
            tail = [s for s in trace if end - TAIL_S <= s[0] <= end]
            name = path.rsplit("/", 1)[-1][:18]
            when = datetime.datetime.fromtimestamp(start, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:12]
            if not tail:
                print(f"{name:<18} {when:<13} no samples in the trace")
                continue
            w = sum(s[1] for s in tail) / len(tail)
            c = sum(s[2] for s in tail) / len(tail)
            r = 0
            for s in tail:
                r |= s[3]
            joules = f"{w * ms / 1e3:9.3f}" if ms is not None else f"{'-':>9}"
            ms_s = f"{ms:10.4f}" if ms is not None else f"{'-':>10}"
            print(f"{name:<18} {when:<13} {w:5.0f} {c:5.0f} {r:#8x} {ms_s} {joules}  {after[:90]}")


if __name__ == "__main__":
    main(sys.argv)
