"""The test files that took the most worker time in a junit XML file (setup, call and teardown of
their tests summed), for .ci/run: a suite that got slower shows which file did it."""
import collections
import sys
import xml.etree.ElementTree as ET


def main(path: str, top: int = 20) -> None:
    seconds, tests = collections.Counter(), collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        seconds[module] += float(case.get("time", 0))
        tests[module] += 1
    print(f"slowest {top} test files ({sum(seconds.values()):.0f} worker-seconds in all):")
    for module, spent in seconds.most_common(top):
        print(f"{spent:8.1f} s  {tests[module]:4d} tests  {module}")


if __name__ == "__main__":
    main(sys.argv[1])
