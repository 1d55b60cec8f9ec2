"""The server does not import the benchmark client: server/ reads none of clients/ (imports at the top and inside
functions alike); `burstserve bench` reaches the server's command line as an entry point (pyproject.toml), and
the installed command has it."""
import ast
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def imported_modules(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module or "")
    return found


def test_server_imports_nothing_of_clients():
    server = os.path.join(ROOT, "burstserve", "server")
    files = [f for f in os.listdir(server) if f.endswith(".py")]
    assert "cli.py" in files
    reads = {f: sorted(m for m in imported_modules(os.path.join(server, f)) if m.split(".")[:2] == ["burstserve", "clients"])
             for f in files}
    assert not any(reads.values()), {f: m for f, m in reads.items() if m}


def test_bench_is_a_subcommand_of_the_installed_command():
    from burstserve.server.cli import added_commands, build_parser
    assert "bench" in added_commands()
    args = build_parser().parse_args(["bench", "sweep", "--lengths", "512", "--output-dir", "x"])
    assert (args.command, args.mode, args.lengths) == ("bench", "sweep", "512")
    for cmd in ([sys.executable, "-m", "burstserve.server.cli", "bench", "--help"], [sys.executable, "-m", "burstserve.clients.bench", "--help"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0 and "sweep" in proc.stdout and "load" in proc.stdout, (cmd, proc.stderr[-500:])
