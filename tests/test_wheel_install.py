"""An install from the wheel works on its own: `pip wheel .` on a fresh copy of the sources, installed
into a new venv, runs `trtprompt demo-checkpoint` and `trtprompt build --profile chat --dry-run` from a
directory outside the checkout (so only the profiles inside the package can be found).

Offline: the wheel is installed with --no-deps, and the new venv sees this venv's site-packages
(torch, transformers, ...) through a .pth line appended after its own, so the installed trtprompt,
not the checkout, is what runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "trtprompt", "profiles")


def _run(*cmd: str | Path, cwd: Path) -> str:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{cmd}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _copy_sources(dest: Path) -> Path:
    """What a fresh clone holds (trtprompt/profiles stays a symlink), without build outputs."""
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = _copy_sources(work / "src")
    assert (src / "trtprompt" / "profiles").is_symlink()
    _run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
         "-w", work / "dist", cwd=src)
    wheel = next((work / "dist").glob("trtprompt-*.whl"))
    env = work / "venv"
    venv.create(env, with_pip=False)  # this venv's pip installs into it (--python): no ensurepip run
    python = env / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel,
         cwd=work)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=work).strip())
    (site / "zz_trtprompt_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    return env


def test_the_installed_package_is_the_wheel(installed: Path) -> None:
    where = _run(installed / "bin" / "python", "-c", "import trtprompt.profile as p; print(p.PROFILES_DIR)",
                 cwd=installed.parent)
    profiles = Path(where.strip())
    assert installed in profiles.parents and not profiles.is_symlink()
    assert sorted(p.name for p in profiles.glob("*.toml")) == sorted(p.name for p in (ROOT / "profiles").glob("*.toml"))


def test_demo_checkpoint_then_build_dry_run(installed: Path) -> None:
    cli, cwd = installed / "bin" / "trtprompt", installed.parent
    made = _run(cli, "demo-checkpoint", cwd / "ckpt", "--size", "tiny", cwd=cwd)
    assert "wrote tiny LlamaForCausalLM checkpoint (seed 0)" in made
    # chat asks for 8192 tokens; the demo model has 4096 positions (the build refuses more).
    plan = _run(cli, "build", cwd / "ckpt", "--profile", "chat", "--max-seq-len", "4096", "--dry-run", cwd=cwd)
    assert "profile    chat" in plan and "max_batch_size" in plan
    assert not (cwd / "engines").exists()
