"""The layout and import rules of the architecture hold: policies replay without torch, the
configuration layer stays the bottom of the stack, models never reach into the runtime, the
runtime never into the command line or the bench, and no module imports itself back."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "adaspec"


def imported_modules(path: Path, *, type_only: bool = True) -> set[str]:
    """Every module ``path`` imports, at any depth (deferred imports count); with
    ``type_only=False`` those under ``if TYPE_CHECKING:`` are left out. ``from a import b``
    names ``a.b`` too where ``b`` is a module."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and \
                    ast.unparse(child.test).endswith("TYPE_CHECKING"):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.add(child.module)
                names.update(f"{child.module}.{alias.name}" for alias in child.names
                             if _is_module(f"{child.module}.{alias.name}"))
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    return name in MODULES


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def modules_of(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def offending(folder: str, allowed_prefixes: tuple[str, ...],
              forbidden: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in modules_of(folder):
        for name in imported_modules(path):
            ours = name == "adaspec" or name.startswith("adaspec.")
            if (ours and not name.startswith(allowed_prefixes)) or name.startswith(forbidden):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return bad


def test_errors_module_imports_nothing_of_ours() -> None:
    assert not any(n.startswith("adaspec") for n in imported_modules(PACKAGE / "errors.py"))


def test_config_imports_only_config_and_errors() -> None:
    assert offending("config", ("adaspec.config", "adaspec.errors"),
                     forbidden=("torch", "numpy")) == []


def test_policies_import_config_and_pure_math_only() -> None:
    assert offending("policies", ("adaspec.policies", "adaspec.config", "adaspec.errors"),
                     forbidden=("torch",)) == []


def test_device_layer_never_imports_policies() -> None:
    # The model protocols are the data contract between kernels and models (VerifyRows).
    assert offending("runtime/devices", ("adaspec.runtime.devices", "adaspec.config",
                                         "adaspec.errors", "adaspec.availability",
                                         "adaspec.models.protocols")) == []


def test_models_never_import_the_runtime() -> None:
    # The device layer imports the model protocols; the device check is a leaf of its own.
    assert offending("models", ("adaspec.models", "adaspec.config", "adaspec.errors",
                                "adaspec.availability")) == []


def test_leaves_import_nothing_of_ours_but_errors() -> None:
    for leaf in ("availability.py", "config/limits.py"):
        ours = {n for n in imported_modules(PACKAGE / leaf) if n.startswith("adaspec")}
        assert ours <= {"adaspec.errors"}, leaf


def test_the_runtime_never_imports_the_command_line_the_bench_or_the_server() -> None:
    assert offending("runtime", ("adaspec",),
                     forbidden=("adaspec.cli", "adaspec.bench", "adaspec.serve")) == []


def test_the_bench_is_a_client_below_the_command_line() -> None:
    assert offending("bench", ("adaspec",), forbidden=("adaspec.cli", "adaspec.serve")) == []


RUNTIME_MODULES = {"__init__", "engine", "pipeline", "rounds", "unified", "split", "calibration",
                   "plans", "drafting", "kv_slots", "requests", "ranks", "trace"}
"""What serves a round: the runtime's own modules beside states/, events/ and devices/."""


def test_the_runtime_holds_what_serves_a_round_and_nothing_else() -> None:
    assert {path.stem for path in (PACKAGE / "runtime").glob("*.py")} == RUNTIME_MODULES
    folders = {path.name for path in (PACKAGE / "runtime").iterdir()
               if path.is_dir() and path.name != "__pycache__"}
    assert folders == {"states", "events", "devices"}


def test_every_subcommand_is_a_module_of_the_command_line() -> None:
    from adaspec.cli import COMMANDS

    assert {path.stem for path in (PACKAGE / "cli").glob("*.py")} == {
        "__init__", "main", "flags", "interrupts", *COMMANDS}


def test_no_import_circle() -> None:
    """Module-level imports and deferred ones alike (a deferred import that closes a circle
    hides a wrong-way dependency); imports only for type checking aside."""
    graph = {name: {n for n in imported_modules(path, type_only=False) if n in MODULES} - {name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return [*path[path.index(other):], other] if other in path else [name, other]
            if other not in state:
                circle = walk(other, [*path, other])
                if circle:
                    return circle
        state[name] = 2
        return None

    for name in MODULES:
        if name not in state:
            circle = walk(name, [name])
            assert circle is None, " -> ".join(circle)


@pytest.mark.parametrize("folder", ["config", "runtime/states", "runtime/events",
                                    "runtime/devices", "policies", "models", "bench", "cli"])
def test_architecture_folders_exist(folder: str) -> None:
    assert (PACKAGE / folder / "__init__.py").is_file()


def test_the_architecture_page_shows_the_layout_that_exists() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    folders = {path.name for path in PACKAGE.iterdir()
               if (path / "__init__.py").is_file()}
    for folder in folders | {"states", "events", "devices"}:
        assert f"{folder}/" in page, folder
    for module in RUNTIME_MODULES - {"__init__"}:
        assert f"{module}.py" in page, module
