"""Print the N slowest tests of one or more pytest JUnit XML reports (setup, call and
teardown together), slowest first: `.ci/run` ends with this across all its pytest runs."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
    n = int(argv[0])
    rows = []
    for path in argv[1:]:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            print(f"slowest tests: cannot read {path}: {e}", file=sys.stderr)
            continue
        for case in root.iter("testcase"):
            rows.append((float(case.get("time", 0)), f"{case.get('classname', '')}::{case.get('name', '')}"))
    rows.sort(reverse=True)
    print(f"the {n} slowest tests of {len(rows)}:")
    for t, name in rows[:n]:
        print(f"{t:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
