import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))   # the project root: the burstserve package
sys.path.insert(0, TESTS)                    # shared test helpers (hf_reference, dist_harness)


# ---- figures: tests record what they measured (cases, streams, tokens, seconds); printed at the end ----
import pytest  # noqa: E402

@pytest.fixture
def figures(request):
    """`figures("reliability: 256 concurrent streams, 8192 tokens, 41.2 s, all exact")` records one line,
    printed in the "reliability figures" section at the end of the run (visible with -q); the lines of a
    test that failed are marked so, not to be quoted. The lines ride in the test's report (user_properties), so
    they reach the end of the run from pytest-xdist's worker processes too (scripts/test.sh runs two)."""
    return lambda line: request.node.user_properties.append(("figure", line))


def pytest_terminal_summary(terminalreporter):
    lines = []
    for key in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(key, []):
            if getattr(report, "when", "call") != "call" and key == "passed":
                continue                                   # a passed test's setup and teardown reports
            for name, line in getattr(report, "user_properties", ()):
                if name == "figure":
                    failed = "" if key == "passed" else f"   [FAILED: {report.nodeid.split('::')[-1]}]"
                    lines.append((report.nodeid, line + failed))
    if not lines:
        return
    terminalreporter.section("reliability figures")
    seen = set()
    for nodeid, line in sorted(lines, key=lambda item: item[0]):
        if (nodeid, line) not in seen:
            seen.add((nodeid, line))
            terminalreporter.write_line(line)
