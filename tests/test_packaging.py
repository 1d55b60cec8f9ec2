"""The distribution installs one import package, `burstserve`, and nothing in the repository's root shadows another
distribution's module: transformers 5.25 imports Hugging Face's `kernels`, which a top-level `kernels/` of ours
shadowed from the root (`burstserve bench --serve ...` and the offline API failed there, 2026-12-07)."""
import os
import shutil
import subprocess
import sys
import zipfile

from paths import ROOT

# the folders at the root that hold no Python module a user could import by accident
NOT_CODE = {"docs", "docker", "scripts", "tests", "build", "dist"}


def test_the_wheel_installs_one_top_level_module(tmp_path):
    """The wheel's RECORD, as pip builds it from pyproject.toml: burstserve and its dist-info, nothing else. Built
    from a copy of the sources, so the build leaves nothing in the checkout."""
    source = tmp_path / "source"
    skipped = shutil.ignore_patterns(".git", ".*venv", "docs", "tests", "build", "wheels", "*.whl", "*.egg-info",
                                     "__pycache__")
    shutil.copytree(ROOT, source, ignore=skipped)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    wheel = next(p for p in os.listdir(tmp_path / "wheel") if p.endswith(".whl"))
    with zipfile.ZipFile(tmp_path / "wheel" / wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        tops = {line.split(",")[0].split("/")[0] for line in z.read(record).decode().splitlines() if line}
        entry_points = z.read(record.replace("RECORD", "entry_points.txt")).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"burstserve"}, tops
    assert "burstserve = burstserve.server.cli:main" in entry_points and "burstserve.clients.bench" in entry_points


def test_the_repository_root_holds_no_module_but_burstserve():
    """Python puts the working directory first on sys.path (`python -m`, `python -c`, a script run there): any
    package or module at the root would shadow an installed one of its name."""
    importable = {name.removesuffix(".py") for name in os.listdir(ROOT)
                  if name.endswith(".py") or os.path.isfile(os.path.join(ROOT, name, "__init__.py"))}
    assert importable == {"burstserve"}, importable
    loose = {name for name in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, name)) and name.isidentifier()
             and not name.startswith(".")} - NOT_CODE - {"burstserve"}     # bench-out/, x.egg-info/: not importable
    assert not loose, f"folders at the root that could become namespace packages: {loose}"


def test_transformers_and_the_offline_api_import_from_the_repository_root():
    """From the root, where the README leaves a user: transformers' own imports (its `kernels` dependency among
    them, where installed) resolve to the installed distributions, and `from burstserve import LLM` works."""
    code = ("import importlib.util, os, sys; import transformers.activations, transformers.models.llama; "
            "from burstserve import LLM, SamplingParams; "
            "spec = importlib.util.find_spec('kernels'); print(spec.origin if spec else '-'); "
            "print(os.path.dirname(os.path.dirname(sys.modules['burstserve'].__file__)))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels_origin, package_parent = proc.stdout.split()
    if kernels_origin != "-":       # not a module or package at the root (a venv inside the checkout is fine)
        origin = os.path.realpath(kernels_origin)
        folder = os.path.dirname(origin)
        where = os.path.dirname(folder) if os.path.basename(origin) == "__init__.py" else folder
        assert where != os.path.realpath(ROOT), kernels_origin
    assert os.path.realpath(package_parent) == os.path.realpath(ROOT)       # this checkout's package
