"""How the test suite's workers spent a run: from the file a run wrote with GRPO_TEST_TIMELINE set (tests/conftest.py).

    GRPO_TEST_TIMELINE=/tmp/t.tsv make test
    .venv/bin/python tests/suite_timeline.py /tmp/t.tsv

Per worker: busy seconds, first start, last end, and the idle time after its last test while another worker still
ran (the tail a better order would remove); then the slowest tests, the xdist groups (the "@group" suffix) with
their total seconds, and the test files by CPU seconds (user + system of the worker and the processes it waited
for, when the file records them: what a cut saves on a busy machine too, where wall seconds mislead)."""

import argparse
import sys
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> list[tuple[str, float, float, str, float | None]]:
    """(worker, start, end, node id, CPU seconds or None) per test; files written before the CPU column read too."""
    rows = []
    for line in path.read_text().splitlines():
        worker, start, end, node, *cpu = line.split("\t")
        rows.append((worker, float(start), float(end), node, float(cpu[0]) if cpu else None))
    if not rows:
        raise SystemExit(f"suite-timeline: {path} has no tests")
    return rows


def summary(rows, top: int = 15) -> str:
    t0, t1 = min(r[1] for r in rows), max(r[2] for r in rows)
    out = [f"{len(rows)} tests, {t1 - t0:.0f} s from the first start to the last end", "",
           "| worker | tests | busy s | first start s | last end s | idle tail s |", "|---|---:|---:|---:|---:|---:|"]
    by_worker = defaultdict(list)
    for r in rows:
        by_worker[r[0]].append(r)
    for worker, rs in sorted(by_worker.items()):
        busy, first, last = sum(r[2] - r[1] for r in rs), min(r[1] for r in rs), max(r[2] for r in rs)
        out.append(f"| {worker} | {len(rs)} | {busy:.0f} | {first - t0:.0f} | {last - t0:.0f} | {t1 - last:.0f} |")
    out += ["", f"Slowest {top}:", ""]
    for worker, s, e, node, cpu in sorted(rows, key=lambda r: r[1] - r[2])[:top]:
        used = "" if cpu is None else f"  ({cpu:.1f} s CPU)"
        out.append(f"  {e - s:7.1f} s  {worker}  starts at {s - t0:6.0f} s  {node}{used}")
    groups = defaultdict(lambda: [0.0, 0, None, 0.0])
    for _worker, s, e, node, _cpu in rows:
        if "@" in node:
            g = groups[node.rsplit("@", 1)[1]]
            g[0] += e - s
            g[1] += 1
            g[2] = s - t0 if g[2] is None else min(g[2], s - t0)
            g[3] = max(g[3], e - t0)
    if groups:
        out += ["", "Groups (one worker each):", ""]
        for name, (total, n, first, last) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
            out.append(f"  {name}: {n} tests, {total:.0f} s, from {first:.0f} s to {last:.0f} s")
    if all(r[4] is not None for r in rows):
        files = defaultdict(lambda: [0.0, 0.0, 0])
        for _worker, s, e, node, cpu in rows:
            f = files[node.split("::", 1)[0]]
            f[0], f[1], f[2] = f[0] + cpu, f[1] + e - s, f[2] + 1
        total = sum(f[0] for f in files.values())
        out += ["", f"Test files by CPU seconds (all: {total:.0f} s; top {top}):", "",
                "| file | tests | CPU s | share | wall s |", "|---|---:|---:|---:|---:|"]
        for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
            out.append(f"| {name} | {n} | {cpu:.0f} | {cpu / total:.0%} | {wall:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    print(summary(read(args.timeline), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
