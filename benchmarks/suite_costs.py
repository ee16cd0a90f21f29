"""What each part of the test suite costs: the junit files `make test` writes (build/test-*.xml)
summed by test file, slowest first, with each file's share of the total.

    python benchmarks/suite_costs.py [--top 40] [FILES...]

Times are pytest's per-test wall times (setup, call and teardown; module fixtures such as rank
pools count towards the first test that uses them). Under xdist two files run at once, so the
sum is about twice the suite's wall time on 2 workers."""

from __future__ import annotations

import argparse
import collections
import glob
import xml.etree.ElementTree as ET


def costs(paths: list[str]) -> dict[str, float]:
    by_file: dict[str, float] = collections.defaultdict(float)
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            module = case.get("classname", "").replace(".", "/") + ".py"
            by_file[module] += float(case.get("time") or 0.0)
    return dict(by_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=sorted(glob.glob("build/test-*.xml")))
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    by_file = costs(args.files)
    total = sum(by_file.values())
    print(f"{len(by_file)} files, {total:.0f} s of test time")
    for module, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {module}")


if __name__ == "__main__":
    main()
