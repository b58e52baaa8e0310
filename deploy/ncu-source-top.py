#!/usr/bin/env python3
"""The SASS instructions with the most warp-state samples in Nsight Compute's source page.

Usage: ncu-source-top.py PAGE.csv [N]. PAGE.csv is what `ncu --import R.ncu-rep --page source
--csv --print-source sass` writes for a report taken with `--section SourceCounters`. Prints the
sample total, then the N (default 20) instructions with the most samples, each with its share.
Column names differ between ncu versions, so the sample column is found by its name, and the
header is printed when none matches.
"""

import csv
import sys


def number(cell):
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
    with open(path, newline="") as f:
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
    for r in sorted(body, key=lambda r: -number(r[col]))[:top]:
        share = 100 * number(r[col]) / total if total else 0.0
        where = f"{r[addr]:>6} " if addr is not None else ""
        print(f"{share:5.1f} %  {where}{r[src].strip()}")


if __name__ == "__main__":
    main()
