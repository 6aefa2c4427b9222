"""Kernel variants per instruction set (engine/isa.py): chosen from the CPU's flags, each one the
machine supports equal to the reference.

The parity tests of the compiled kernels (tests/test_layer_ops.py, tests/test_attention_paths.py, the
int8 KV kernels' in tests/test_kv_int8.py, the LoRA kernel's, tests/test_lora_kernel.py, and whether AMX
runs, tests/test_amx_linear.py) run in the default variant with the rest of the suite; here they run again
in a child process for every other variant this CPU supports (one process loads one variant: they define
the same ops). `make install` builds them all (`python -m trtprompt.engine.kernels --all`), so the children
only load them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from trtprompt.engine import isa, kernels

AVX2_FLAGS = frozenset("fpu sse2 avx avx2 fma f16c".split())
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile"}
PARITY = ("fast_paths_equal_reference or log_sum_exp or rms_norm or silu or rotary or int8_in_place or lora_kernel "
          "or quantize_rows or scale_rows or kernel_matches_torch_for_every_row_count "
          "or weight_only_linear_on_both_sides_of_the_threshold or greedy_tokens_is_argmax or amx_is_ready "
          "or panel_kernel or one_call_equals_the_layer_loop")


def test_flags_are_read_from_cpuinfo_on_x86_and_arm(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma f16c\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert isa.cpu_flags(x86) == frozenset({"fpu", "avx2", "fma", "f16c"})
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n")
    assert isa.cpu_flags(arm) == frozenset({"fp", "asimd", "evtstrm", "crc32"})


def test_the_best_supported_variant_is_chosen() -> None:
    assert isa.choose(AVX512_FLAGS, None).name == "avx512"
    assert isa.choose(AVX2_FLAGS, None).name == "avx2"
    assert isa.choose(frozenset({"fp", "asimd"}), None).name == "generic"
    assert [v.name for v in isa.supported(AVX512_FLAGS)] == ["avx512", "avx2", "generic"]
    assert isa.choose(AVX512_FLAGS, "avx2").name == "avx2"  # an AVX-512 machine may run the AVX2 build


def test_a_requested_variant_the_cpu_lacks_is_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError, match=r"TRTPROMPT_KERNEL_ISA='avx512': this CPU lacks avx512bw, avx512dq, "
                                         r"avx512f, avx512vl \(it runs: avx2, generic\)"):
        isa.choose(AVX2_FLAGS, "avx512")
    with pytest.raises(ValueError, match=r"not a kernel variant \(choices: avx512, avx2, generic\)"):
        isa.choose(AVX2_FLAGS, "sse9")


def test_each_variant_builds_under_its_own_name_and_flags() -> None:
    names = {kernels._build_flags(v)[0] for v in isa.VARIANTS}
    tail = f"_{kernels._checkout_digest()}"
    assert names == {f"trtprompt_kernels_{v}{tail}" for v in ("avx512", "avx2", "generic")}
    avx512 = kernels._build_flags(isa.BY_NAME["avx512"])[1]
    assert "-mavx512f" in avx512 and "-DTRTPROMPT_LANES=16" in avx512
    assert not any(f.startswith("-m") for f in kernels._build_flags(isa.BY_NAME["generic"])[1])


def _child(variant: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, isa.ISA_ENV: variant}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def test_an_unsupported_request_falls_back_to_pure_torch_saying_why() -> None:
    code = "from trtprompt.engine import kernels; print(kernels.compiled_kernel_status())"
    out = _child("sse9", "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("(False, \"TRTPROMPT_KERNEL_ISA='sse9': not a kernel variant"), out.stdout


OTHERS = [v.name for v in isa.supported(isa.cpu_flags()) if v != kernels.variant()]
# One child per variant: it prints the kernel it loaded, then runs the parity tests in that same process.
CHILD = ("import sys, pytest; from trtprompt.engine import kernels; "
         "print(kernels.compiled_kernel_status()[1], flush=True); sys.exit(pytest.main(sys.argv[1:]))")


@pytest.fixture(scope="module")
def children() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Every other variant's child, started together (each waits on imports and one core, not on the others)."""
    tests = Path(__file__).parent
    args = ["-q", "-p", "no:cacheprovider", "-k", PARITY,
            *(str(tests / f) for f in ("test_layer_ops.py", "test_attention_paths.py", "test_kv_int8.py",
                                          "test_lora_kernel.py", "test_int8_w8a8.py",
                                          "test_few_rows_linear.py", "test_step_overhead.py", "test_amx_linear.py",
                                          "test_panel_linear.py", "test_decode_layers.py"))]
    started = {v: subprocess.Popen([sys.executable, "-c", CHILD, *args], env={**os.environ, isa.ISA_ENV: v},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in OTHERS}
    yield started
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="no compiled kernels on this machine")
@pytest.mark.parametrize("variant", OTHERS)
def test_every_other_supported_variant_equals_the_reference(variant: str,
                                                            children: dict[str, subprocess.Popen[str]]) -> None:
    out, err = children[variant].communicate(timeout=600)
    status, _, tail = out.partition("\n")
    name = f"trtprompt_kernels_{variant}_{kernels._checkout_digest()}"
    assert status == f"compiled kernel {name} ({variant}: {isa.BY_NAME[variant].lanes}-float vectors)", err[-2000:]
    assert children[variant].returncode == 0, tail[-3000:]
    assert " passed" in tail and "skipped" not in tail, tail[-500:]


def test_a_killed_builds_lock_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    """torch's loader waits forever on a `lock` a killed build left; one older than any build is cleared."""
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not kernels.clear_stale_lock(tmp_path)  # fresh: another process may be building
    assert lock.exists()
    assert kernels.clear_stale_lock(tmp_path, now=time.time() + kernels.STALE_LOCK_SECONDS + 1)
    assert not lock.exists()
    assert not kernels.clear_stale_lock(tmp_path)  # nothing left to clear
