#!/usr/bin/env python3
"""The SASS instructions with the most warp-state samples in Nsight Compute's source page.

Usage: ncu-source-top.py PAGE.csv[.gz] [N]. PAGE.csv is what `ncu --import R.ncu-rep --page source
--csv --print-source sass` writes for a report taken with `--section SourceCounters`. Prints the
sample total and the kernel's share of each stall reason, then the N (default 20) instructions
with the most samples, each with its share and its three main stall reasons.
Column names differ between ncu versions, so the sample column is found by its name, and the
header is printed when none matches.
"""

import csv
import gzip
import sys


def number(cell):
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    # The header is the first row naming the instruction text.
    head = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if head is None:
        sys.exit(f"{path}: no header row with a Source column among {len(rows)} rows")
    names = rows[head]
    samples = [i for i, n in enumerate(names) if "Warp Stall Sampling (All" in n]
    if not samples:
        sys.exit(f"{path}: no warp-sampling column; the columns are: {names}")
    col, src = samples[0], names.index("Source")
    addr = names.index("Address") if "Address" in names else None
    body = [r for r in rows[head + 1 :] if len(r) == len(names)]
    total = sum(number(r[col]) for r in body)
    print(f"{names[col]}: {total:.0f} samples over {len(body)} instructions")
    # Per-reason columns (stall_long_sb, ...); the "(Not Issued)" copies are left out.
    reasons = [i for i, n in enumerate(names) if n.startswith("stall_") and "Not Issued" not in n]

    def pct(v):
        return 100 * v / total if total else 0.0

    sums = sorted(((sum(number(r[i]) for r in body), names[i][6:]) for i in reasons), reverse=True)
    print("  ".join(f"{n} {pct(v):.1f} %" for v, n in sums[:8] if v > 0))
    ranked = sorted(body, key=lambda r: -number(r[col]))[:top]
    for r in ranked:
        where = f"{r[addr]:>6} " if addr is not None else ""
        main3 = sorted(((number(r[i]), names[i][6:]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{n} {pct(v):.1f}" for v, n in main3 if v > 0)
        print(f"{pct(number(r[col])):5.1f} %  {where}{r[src].strip():<60} [{why}]")
    # Last, one line for a summary that keeps only a log's last line.
    if ranked:
        first = ranked[0]
        print(
            f"most: {pct(number(first[col])):.1f} % at {first[src].strip()}; "
            + ", ".join(f"{n} {pct(v):.1f} %" for v, n in sums[:3])
        )


if __name__ == "__main__":
    main()
