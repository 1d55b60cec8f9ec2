import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))   # the project root: the burstserve package
sys.path.insert(0, TESTS)                    # shared test helpers (hf_reference, dist_harness)


# ---- figures: tests record what they measured (cases, streams, tokens, seconds); printed at the end ----
import pytest  # noqa: E402

_FIGURES: list[tuple[str, str]] = []   # (test node id, line)


@pytest.fixture
def figures(request):
    """`figures("reliability: 256 concurrent streams, 8192 tokens, 41.2 s, all exact")` records one line,
    printed in the "reliability figures" section at the end of the run (visible with -q); the lines of a
    test that failed are marked so, not to be quoted."""
    return lambda line: _FIGURES.append((request.node.nodeid, line))


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    failed = {r.nodeid for key in ("failed", "error") for r in terminalreporter.stats.get(key, [])}
    terminalreporter.section("reliability figures")
    for nodeid, line in _FIGURES:
        terminalreporter.write_line(line + (f"   [FAILED: {nodeid.split('::')[-1]}]" if nodeid in failed else ""))
