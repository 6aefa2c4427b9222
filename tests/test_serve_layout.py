"""trtprompt/serve is laid out by process (trtprompt/serve/__init__.py): each subpackage imports only
what its docstring allows, function-level imports included, and nothing forms an import circle.
Read from the source (AST), nothing imported."""

from __future__ import annotations

import pytest

from tests.test_imports import MODULES, PACKAGE, cycles, graph, imported_names

SERVE = "trtprompt.serve"
SUBPACKAGES = ("launch", "triton_models", "engine_process", "openai", "wire")
MAX_LOOSE_MODULES = 6
# subpackage -> the serve subpackages it must never import (module or function level)
FORBIDDEN = {
    "wire": ("launch", "triton_models", "engine_process", "openai"),
    "engine_process": ("launch", "triton_models", "openai"),
    "triton_models": ("launch", "engine_process", "openai"),
    "openai": ("launch", "triton_models", "engine_process"),
    "launch": ("triton_models", "engine_process"),
}
# subpackage -> third-party modules it must never import (wire reads config.pbtxt with tritonclient's
# ModelConfig schema, a protobuf module; it opens no gRPC channel)
FORBIDDEN_EXTERNAL = {
    "wire": ("triton_python_backend_utils", "grpc", "starlette", "uvicorn", "click", "torch"),
    "engine_process": ("tritonclient", "triton_python_backend_utils", "grpc", "starlette", "uvicorn", "click"),
    "openai": ("triton_python_backend_utils", "click"),
    "launch": ("triton_python_backend_utils",),
}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _subpackage(module: str) -> str | None:
    return next((s for s in SUBPACKAGES if _in(module, f"{SERVE}.{s}")), None)


def _serve_modules() -> list[str]:
    return sorted(m for m in MODULES if _in(m, SERVE))


def test_serve_has_few_loose_modules() -> None:
    loose = sorted(p.name for p in (PACKAGE / "serve").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, loose
    for name in SUBPACKAGES:
        assert (PACKAGE / "serve" / name / "__init__.py").read_text(encoding="utf-8").startswith('"""'), name


@pytest.mark.parametrize("sub", sorted(FORBIDDEN))
def test_each_subpackage_imports_only_what_it_may(sub: str) -> None:
    found = []
    for module in _serve_modules():
        if _subpackage(module) != sub:
            continue
        for name in imported_names(module, module_level_only=False):
            other = _subpackage(name) if _in(name, SERVE) else None
            if other in FORBIDDEN[sub] or name.split(".")[0] in FORBIDDEN_EXTERNAL.get(sub, ()):
                found.append(f"{module} imports {name}")
    assert not found, found


def test_loose_serve_modules_import_no_subpackage() -> None:
    loose = [m for m in _serve_modules() if _subpackage(m) is None and m != SERVE]
    found = [f"{m} imports {n}" for m in loose for n in imported_names(m, False) if _subpackage(n) is not None]
    assert not found, found


def test_triton_stub_api_only_inside_triton_models() -> None:
    found = [m for m in MODULES if "triton_python_backend_utils" in imported_names(m, False)
             and _subpackage(m) != "triton_models"]
    assert not found, found


def test_client_imports_nothing_of_serve() -> None:
    assert not [n for n in imported_names("trtprompt.client", False) if _in(n, SERVE)]


def test_no_import_circle_through_function_level_imports() -> None:
    assert cycles(graph(module_level_only=False)) == []
