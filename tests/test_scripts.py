"""Every script in scripts/ imports: a module the package moved, renamed or dropped fails here rather than
in the hands of whoever next runs the benchmark. (What the scripts measure is not a test; see each one.)"""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_the_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))  # scripts import their neighbours (interop -> peers)
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # runs the imports and definitions; main() sits behind __main__
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
