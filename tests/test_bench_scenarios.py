"""The measuring scenarios under trtprompt/bench/scenarios/ (issue 40 item 6): each answers --help, and no
script in scripts/ edits sys.path (a thin caller imports the installed package instead)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import trtprompt.bench.scenarios as scenarios

ROOT = Path(__file__).resolve().parent.parent

# One process runs every scenario as `python -m NAME --help` does (runpy.run_module as __main__, sys.argv
# set), so torch is imported once: a process per scenario would take about 3 s each on 2 cores.
HELP_ALL = """
import contextlib, io, json, runpy, sys
codes = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
            codes[name] = "returned without exiting"
        except SystemExit as exc:
            codes[name] = exc.code if "usage" in out.getvalue().lower() else f"{exc.code}, no usage printed"
print(json.dumps(codes))
"""


def scenario_modules() -> list[str]:
    """Every runnable scenario; modules named _* hold what several share and have no command line."""
    return sorted(f"{scenarios.__name__}.{m.name}" for m in pkgutil.iter_modules(scenarios.__path__)
                  if not m.name.startswith("_"))


def test_every_scenario_answers_help() -> None:
    names = scenario_modules()
    assert len(names) >= 21, names
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *names], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == {name: 0 for name in names}


def test_no_script_edits_sys_path() -> None:
    edits = [p.name for p in sorted((ROOT / "scripts").iterdir())
             if p.is_file() and "sys.path" in p.read_text(encoding="utf-8", errors="replace")]
    assert edits == []


def test_thin_callers_name_a_scenario_that_exists() -> None:
    """A script left in scripts/ for the command lines in BENCHMARKS.md calls a module that is there."""
    modules = set(scenario_modules())
    callers = {p.name: line.split()[1] for p in (ROOT / "scripts").glob("*.py")
               for line in p.read_text(encoding="utf-8").splitlines()
               if line.startswith("from trtprompt.bench.scenarios.")}
    assert callers and set(callers.values()) <= modules, callers
