"""The import rules of the architecture hold, so that policies replay without torch and the
configuration layer stays the bottom of the stack."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "adaspec"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


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
                                         "adaspec.errors", "adaspec.models.protocols")) == []


def test_models_import_only_config_errors_and_the_device_check() -> None:
    # Only the availability check: the device layer imports the model protocols, so a wider
    # import here would be a cycle.
    assert offending("models", ("adaspec.models", "adaspec.config", "adaspec.errors",
                                "adaspec.runtime.devices.availability")) == []


@pytest.mark.parametrize("folder", ["config", "runtime/states", "runtime/events",
                                    "runtime/devices", "policies", "models"])
def test_architecture_folders_exist(folder: str) -> None:
    assert (PACKAGE / folder / "__init__.py").is_file()
