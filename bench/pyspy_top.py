"""Top frames of a py-spy ``--format raw`` profile (collapsed stacks).

    python -m bench.pyspy_top bench/results/DATE-MACHINE/logs/pyspy-gateway.txt [N]

Prints the N functions with the most samples on top of the stack (self) and anywhere in
it (inclusive), and the share of samples that pass through the gateway's own code.
"""

from __future__ import annotations

import sys
from collections import Counter


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    with open(path, errors="replace") as fh:
        lines = fh.readlines()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if f]
        if frames:
            self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    print(f"{total} samples")
    for title, counter in (("self", self_c), ("inclusive", incl)):
        print(f"\n-- top {top} by {title} --")
        for frame, n in counter.most_common(top):
            print(f"{100 * n / max(total, 1):6.2f}%  {frame}")
    gw = Counter({f: n for f, n in incl.items() if "(gateway/" in f})
    print("\n-- gateway frames (inclusive) --")
    for frame, n in gw.most_common(top):
        print(f"{100 * n / max(total, 1):6.2f}%  {frame}")


if __name__ == "__main__":
    main()
