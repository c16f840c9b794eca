"""Sum a CPU probe's log (.ci/cpu/sitecustomize.py) by kind of process, by test file and by test:
which of the suite's processes its CPU seconds are made of."""
import collections
import json
import sys


def kind(record: dict) -> str:
    argv = record["argv"]
    if record["forked"]:
        return "forked (ranks, zygotes)"
    if '"idle"' in argv:  # python -c CODE SPEC: the keeper's JSON spec, its code is not in argv
        return "pool keeper"
    if argv in ("-c", "") or "exec(eval" in argv:
        return "xdist worker or python -c"
    if "pytest" in argv:
        return "pytest (a user's run)"
    for tool in ("bisect", "explore", "golden", "zoo", "report", "pool", "bench"):
        if f"harness/{tool}/" in argv or f"harness.{tool}" in argv:
            return f"python -m harness.{tool}"
    return "other"


def main(path: str, top: int = 25) -> None:
    records = [json.loads(line) for line in open(path) if line.strip()]
    by_kind, count = collections.Counter(), collections.Counter()
    by_file, by_test = collections.Counter(), collections.Counter()
    for r in records:
        name = kind(r)
        by_kind[name] += r["cpu"]
        count[name] += 1
        by_file[r["test"].split("::")[0] or "(no test)"] += r["cpu"]
        by_test[r["test"] or "(no test)"] += r["cpu"]
    print(f"{sum(by_kind.values()):.0f} CPU-s in {len(records)} processes that ended by exit")
    print("by kind of process:")
    for name, cpu in by_kind.most_common():
        print(f"{cpu:8.0f} s  {count[name]:5d} processes  {cpu / count[name]:6.2f} s each  {name}")
    for title, counter in (("by test file", by_file), ("by test", by_test)):
        print(f"{title} (the processes it started):")
        for name, cpu in counter.most_common(top):
            print(f"{cpu:8.0f} s  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
