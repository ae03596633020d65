"""Selector matching, the import hook and the class-creation hook.

Cases that depend on what a fresh interpreter has imported (torch after install, ``from x import C``
before install, the two-thread import) run in a subprocess; the rest use uniquely named temporary
modules in this process and always uninstall the hook.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ort_autopatch.hook import PATCHED_MARKER, ImportHook, Selector

REPO = pathlib.Path(__file__).resolve().parents[1]


# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def name() -> str:
    """A module name no other test (or earlier run in this process) uses."""
    return f"ap_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def write(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Write ``{relative path: source}`` under a folder on sys.path; forget the modules after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write_files(files: dict[str, str]) -> None:
        for relative, source in files.items():
            path = tmp_path / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source), encoding="utf-8")
            written.append(relative.split("/")[0].removesuffix(".py"))
        importlib.invalidate_caches()

    yield write_files
    for top in written:
        for module in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[module]


class Recorder:
    """An on_class callback that records classes and marks them patched, as the patcher would."""

    def __init__(self, fail: bool = False) -> None:
        self.classes: list[type] = []
        self.fail = fail

    def __call__(self, cls: type) -> None:
        self.classes.append(cls)
        if self.fail:
            raise RuntimeError("patcher exploded")
        setattr(cls, PATCHED_MARKER, True)

    @property
    def names(self) -> list[str]:
        return [cls.__qualname__ for cls in self.classes]


@pytest.fixture
def make_hook() -> Iterator[Callable[..., tuple[ImportHook, Recorder]]]:
    """Build and install hooks; every one is uninstalled at the end of the test."""
    hooks: list[ImportHook] = []

    def make(
        modules: list[str], exclude: list[str] | None = None, fail: bool = False
    ) -> tuple[ImportHook, Recorder]:
        recorder = Recorder(fail=fail)
        hook = ImportHook(Selector(modules, exclude or []), recorder)
        hooks.append(hook)
        hook.install()
        return hook, recorder

    yield make
    for hook in reversed(hooks):
        hook.uninstall()


MODELS = """
    import torch

    class Net(torch.nn.Module):
        pass

    class Head(torch.nn.Module):
        pass
"""

NESTED = """
    import torch

    class Outer:
        class Inner(torch.nn.Module):
            pass
"""

FACTORY = """
    import torch

    def build():
        class Net(torch.nn.Module):
            pass
        return Net
"""


def run_python(code: str, cwd: pathlib.Path) -> str:
    """Run ``code`` in a fresh interpreter that sees the repository and ``cwd``; return stdout."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO), str(cwd)])
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# --- Selector -----------------------------------------------------------------------------------


def test_selector_matches_exact_module_and_class() -> None:
    selector = Selector(["mypkg.models:Net"], [])
    assert selector.matches("mypkg.models", "Net")
    assert not selector.matches("mypkg.models", "Head")
    assert not selector.matches("mypkg.other", "Net")


def test_selector_wildcards_work_on_both_sides() -> None:
    selector = Selector(["mypkg.*:*Head", "lib?.layers:Block[0-9]"], [])
    assert selector.matches("mypkg.models.vision", "ClsHead")
    assert selector.matches("lib2.layers", "Block7")
    assert not selector.matches("mypkg", "ClsHead")
    assert not selector.matches("lib2.layers", "BlockX")


def test_selector_is_case_sensitive() -> None:
    assert not Selector(["mypkg:Net"], []).matches("MyPkg", "net")


def test_selector_matches_qualname_and_plain_name() -> None:
    selector = Selector(["m:Outer.Inner", "m:Local"], [])
    assert selector.matches("m", "Outer.Inner")
    assert selector.matches("m", "build.<locals>.Local")
    assert not selector.matches("m", "Inner")


def test_selector_exclude_wins() -> None:
    selector = Selector(["mypkg.*:*"], ["mypkg.debug:*", "*:Probe*"])
    assert selector.matches("mypkg.models", "Net")
    assert not selector.matches("mypkg.debug", "Net")
    assert not selector.matches("mypkg.models", "ProbeNet")


def test_selector_main_patterns_also_select_mp_main() -> None:
    selector = Selector(["__main__:Net"], [])
    assert selector.may_match_module("__mp_main__")
    assert selector.matches("__mp_main__", "Net")


def test_may_match_module_is_false_for_modules_no_pattern_can_match() -> None:
    selector = Selector(["mypkg.models:Net", "other.*:X"], [])
    assert selector.may_match_module("mypkg.models")
    assert selector.may_match_module("other.sub")
    assert not selector.may_match_module("mypkg")
    assert not selector.may_match_module("torch.nn.modules.linear")
    assert not selector.may_match_module("otherwise")


def test_may_match_module_is_false_for_wholly_excluded_modules() -> None:
    selector = Selector(["mypkg.*:*"], ["mypkg.tests.*:*"])
    assert selector.may_match_module("mypkg.models")
    assert not selector.may_match_module("mypkg.tests.test_models")


def test_may_match_module_with_leading_wildcard_matches_any_module() -> None:
    selector = Selector(["*.models:Net"], [])
    assert selector.may_match_module("a.models")
    assert not selector.may_match_module("a.layers")


def test_unmatched_lists_patterns_that_never_matched_a_class() -> None:
    selector = Selector(["a:Net", "a:Typo", "b.*:*"], ["a:Net"])
    selector.matches("a", "Net")
    selector.matches("b.c", "Anything")
    assert selector.unmatched() == ["a:Typo"]


def test_selector_rejects_a_pattern_without_class() -> None:
    with pytest.raises(ValueError, match=r"module\.path:Class"):
        Selector(["mypkg.models"], [])


def test_selector_survives_concurrent_use() -> None:
    selector = Selector(["pkg.*:Net*", "exact:A"], ["pkg.x:*"])
    errors: list[BaseException] = []
    results: list[bool] = []

    def work(offset: int) -> None:
        try:
            for i in range(2000):
                module = f"pkg.m{(i + offset) % 50}"
                results.append(selector.matches(module, f"Net{i % 7}"))
                selector.may_match_module(f"unrelated{i}")
                selector.unmatched()
        except BaseException as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert all(results) and len(results) == 8 * 2000
    assert selector.unmatched() == ["exact:A"]


# --- the import hook ----------------------------------------------------------------------------


def test_module_imported_after_install_delivers_its_classes(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    _, recorder = make_hook([f"{name}:Net"])
    module = importlib.import_module(name)
    assert recorder.classes == [module.Net]


def test_module_imported_before_install_is_scanned_at_install(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    module = importlib.import_module(name)
    _, recorder = make_hook([f"{name}:*"])
    assert sorted(recorder.names) == ["Head", "Net"]
    assert set(recorder.classes) == {module.Net, module.Head}


def test_install_scan_delivers_classes_in_definition_order(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    importlib.import_module(name)
    _, recorder = make_hook([f"{name}:*"])
    assert recorder.names == ["Net", "Head"]


def test_nested_classes_are_found_by_qualname(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": NESTED})
    importlib.import_module(name)
    _, recorder = make_hook([f"{name}:Outer.Inner"])
    assert recorder.names == ["Outer.Inner"]


def test_imported_classes_are_not_delivered_for_the_importing_module(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS, f"{name}_user.py": f"from {name} import Net\n"})
    _, recorder = make_hook([f"{name}_user:*"])
    importlib.import_module(f"{name}_user")
    assert recorder.classes == []


def test_package_and_submodule_imports_still_work(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write(
        {
            f"{name}/__init__.py": MODELS,
            f"{name}/sub/__init__.py": "",
            f"{name}/sub/layers.py": MODELS.replace("Net", "Block"),
        }
    )
    _, recorder = make_hook([f"{name}*:Net", f"{name}.sub.*:Block"])
    layers = importlib.import_module(f"{name}.sub.layers")
    package = sys.modules[name]
    assert recorder.classes == [package.Net, layers.Block]
    assert package.__path__ == [str(pathlib.Path(str(package.__file__)).parent)]


def test_namespace_package_imports_still_work(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}/models.py": MODELS})
    _, recorder = make_hook([f"{name}*:Net"])
    models = importlib.import_module(f"{name}.models")
    namespace = sys.modules[name]
    assert recorder.classes == [models.Net]
    assert namespace.__file__ is None
    assert list(namespace.__path__) == [str(pathlib.Path(str(models.__file__)).parent)]
    assert namespace.__spec__ is not None
    assert type(namespace.__spec__.loader).__name__ in ("NoneType", "NamespaceLoader")


def test_loader_and_spec_loader_are_the_original_loader(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}/__init__.py": MODELS})
    make_hook([f"{name}:*"])
    module = importlib.import_module(name)
    assert type(module.__loader__) is importlib.machinery.SourceFileLoader
    assert module.__spec__ is not None
    assert module.__spec__.loader is module.__loader__


def test_user_import_error_propagates_unchanged(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": "import ap_this_does_not_exist_anywhere\n"})
    make_hook([f"{name}:*"])
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(name)
    assert info.value.name == "ap_this_does_not_exist_anywhere"
    assert name not in sys.modules


def test_user_exception_in_module_body_propagates_unchanged(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": "1 / 0\n"})
    make_hook([f"{name}:*"])
    with pytest.raises(ZeroDivisionError):
        importlib.import_module(name)
    assert name not in sys.modules


def test_on_class_error_is_logged_and_the_import_succeeds(
    name: str,
    write: Callable[..., None],
    make_hook: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    write({f"{name}.py": MODELS})
    _, recorder = make_hook([f"{name}:Net"], fail=True)
    with caplog.at_level(logging.ERROR, logger="ort_autopatch"):
        module = importlib.import_module(name)
    assert recorder.classes == [module.Net]
    assert "patcher exploded" in caplog.text
    assert f"{name}:Net" in caplog.text


def test_class_created_in_a_function_later_is_delivered_when_created(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": FACTORY})
    _, recorder = make_hook([f"{name}:Net"])
    module = importlib.import_module(name)
    assert recorder.classes == []
    net = module.build()
    assert recorder.classes == [net]


def test_class_created_in_main_is_delivered_when_created(make_hook: Callable[..., Any]) -> None:
    _, recorder = make_hook(["__main__:Net"])
    namespace: dict[str, Any] = {"__name__": "__main__", "torch": torch}
    exec("class Net(torch.nn.Module):\n    pass\n", namespace)
    assert recorder.classes == [namespace["Net"]]


def test_subclass_of_patched_class_is_delivered(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    _, recorder = make_hook([f"{name}:Net"])
    module = importlib.import_module(name)

    class Custom(module.Net):  # type: ignore[name-defined]
        pass

    class Deeper(Custom):
        pass

    assert recorder.classes == [module.Net, Custom, Deeper]


def test_excluded_subclass_of_patched_class_is_not_delivered(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    _, recorder = make_hook([f"{name}:Net"], exclude=[f"{__name__}:*Debug*"])
    module = importlib.import_module(name)

    class DebugNet(module.Net):  # type: ignore[name-defined]
        pass

    assert recorder.classes == [module.Net]


def test_each_class_is_delivered_once_though_both_hooks_see_it(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    hook, recorder = make_hook([f"{name}:Net"])
    importlib.import_module(name)  # seen by __init_subclass__ and by the post-import scan
    hook.uninstall()
    hook.install()  # and by the install-time scan
    assert recorder.names == ["Net"]


def test_non_module_class_named_outright_is_skipped_with_one_warning(
    name: str,
    write: Callable[..., None],
    make_hook: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    write({f"{name}.py": "class Settings:\n    pass\n"})
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        hook, recorder = make_hook([f"{name}:Settings"])
        importlib.import_module(name)
        hook.uninstall()
        hook.install()
    assert recorder.classes == []
    warnings = [r for r in caplog.records if f"{name}:Settings" in r.getMessage()]
    assert len(warnings) == 1
    assert "not a torch.nn.Module subclass" in warnings[0].getMessage()


def test_wildcard_over_non_module_classes_skips_them_silently(
    name: str,
    write: Callable[..., None],
    make_hook: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What `--modules 'torchvision.models.*:*'` meets: weight enums, helpers, dataclasses.
    helpers = "".join(f"class Weights{i}(enum.Enum):\n    A = 1\n" for i in range(20))
    helpers += "".join(f"class Helper{i}:\n    pass\n" for i in range(20))
    net = "class Net(torch.nn.Module):\n    pass\n"
    write({f"{name}.py": f"import enum\nimport torch\n{helpers}{net}"})
    with caplog.at_level(logging.DEBUG, logger="ort_autopatch"):
        _, recorder = make_hook([f"{name[:-2]}*:*"])
        importlib.import_module(name)
    assert recorder.names == ["Net"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_reload_delivers_each_new_class_object_once(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    _, recorder = make_hook([f"{name}:Net"])
    module = importlib.import_module(name)
    first = module.Net
    importlib.reload(module)
    assert recorder.classes == [first, module.Net]
    assert first is not module.Net
    assert module.__spec__ is not None
    assert module.__spec__.loader is module.__loader__
    assert type(module.__loader__) is importlib.machinery.SourceFileLoader


def test_finder_answers_none_without_looking_for_unmatched_modules(
    make_hook: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_hook(["mypkg.models:Net"])
    finder = sys.meta_path[0]
    looked: list[str] = []

    class Spy:
        def find_spec(self, fullname: str, path: object, target: object = None) -> None:
            looked.append(fullname)

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Spy()])
    assert finder.find_spec("json.decoder", None) is None
    assert finder.find_spec("mypkg.models", None) is None  # matches, but nothing provides it
    assert looked == ["mypkg.models"]


def test_finder_answers_none_to_lookups_it_started_itself(
    name: str, write: Callable[..., None], make_hook: Callable[..., Any]
) -> None:
    write({f"{name}.py": MODELS})
    make_hook([f"{name}:*"])
    finder = sys.meta_path[0]
    inner: list[object] = []

    class CallsBack:
        """Like finders that ask the import system again (the ddtrace/wrapt pattern)."""

        def find_spec(self, fullname: str, path: object, target: object = None) -> None:
            if fullname == name:
                inner.append(finder.find_spec(fullname, None))

    sys.meta_path.insert(1, CallsBack())
    try:
        spec = finder.find_spec(name, None)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, CallsBack)]
    assert spec is not None and spec.name == name
    assert inner == [None]


def test_install_puts_the_finder_first_and_uninstall_removes_it(
    make_hook: Callable[..., Any],
) -> None:
    before = list(sys.meta_path)
    hook, _ = make_hook(["mypkg:Net"])
    assert sys.meta_path[1:] == before
    hook.uninstall()
    assert sys.meta_path == before


def test_install_twice_is_a_no_op_with_a_debug_log(
    make_hook: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    before = list(sys.meta_path)
    hook, _ = make_hook(["mypkg:Net"])
    hooked = torch.nn.Module.__dict__["__init_subclass__"]
    with caplog.at_level(logging.DEBUG, logger="ort_autopatch"):
        hook.install()
    assert len(sys.meta_path) == len(before) + 1
    assert torch.nn.Module.__dict__["__init_subclass__"] is hooked
    assert "already installed" in caplog.text


def test_uninstall_removes_init_subclass_when_torch_had_none(
    make_hook: Callable[..., Any],
) -> None:
    assert "__init_subclass__" not in torch.nn.Module.__dict__
    hook, _ = make_hook(["mypkg:Net"])
    assert "__init_subclass__" in torch.nn.Module.__dict__
    hook.uninstall()
    assert "__init_subclass__" not in torch.nn.Module.__dict__


def test_existing_init_subclass_is_chained_and_restored_exactly(
    make_hook: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[type, dict[str, Any]]] = []

    def existing(cls: type, **kwargs: Any) -> None:
        seen.append((cls, kwargs))

    original: Any = classmethod(existing)
    monkeypatch.setattr(torch.nn.Module, "__init_subclass__", original, raising=False)
    hook, recorder = make_hook(["__main__:Net"])
    namespace: dict[str, Any] = {"__name__": "__main__", "torch": torch}
    exec("class Net(torch.nn.Module, flavour='x'):\n    pass\n", namespace)
    assert seen == [(namespace["Net"], {"flavour": "x"})]
    assert recorder.classes == [namespace["Net"]]
    hook.uninstall()
    assert torch.nn.Module.__dict__["__init_subclass__"] is original


def test_hooks_installed_twice_unwind_in_reverse_order(make_hook: Callable[..., Any]) -> None:
    first, _ = make_hook(["a:B"])
    second, _ = make_hook(["c:D"])
    second.uninstall()
    first.uninstall()
    assert "__init_subclass__" not in torch.nn.Module.__dict__


# --- fresh interpreters -------------------------------------------------------------------------


# The children print what they saw and the assertions live here: an assert in the child would
# vanish under an inherited PYTHONOPTIMIZE.


def test_torch_imported_after_install_gets_the_class_creation_hook(tmp_path: pathlib.Path) -> None:
    out = run_python(
        """
        import json, sys
        from ort_autopatch.hook import ImportHook, Selector
        classes = []
        hook = ImportHook(Selector(["__main__:Net"], []), classes.append)
        hook.install()
        seen = {"torch_after_install": "torch" in sys.modules}
        import torch
        seen["hooked"] = "__init_subclass__" in torch.nn.Module.__dict__
        class Net(torch.nn.Module):
            pass
        seen["found"] = [c is Net for c in classes]
        hook.uninstall()
        seen["hooked_after_uninstall"] = "__init_subclass__" in torch.nn.Module.__dict__
        print(json.dumps(seen))
        """,
        tmp_path,
    )
    assert json.loads(out) == {
        "torch_after_install": False,  # installing the hook must not import torch
        "hooked": True,
        "found": [True],
        "hooked_after_uninstall": False,
    }


def test_from_import_before_install_still_gets_the_same_class_object(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "early_models.py").write_text(textwrap.dedent(MODELS), encoding="utf-8")
    out = run_python(
        """
        import json
        from early_models import Net
        from ort_autopatch.hook import ImportHook, Selector
        classes = []
        ImportHook(Selector(["early_models:Net"], []), classes.append).install()
        print(json.dumps([c is Net for c in classes]))
        """,
        tmp_path,
    )
    assert json.loads(out) == [True]


def test_matched_class_without_torch_is_skipped_and_torch_stays_unimported(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "plain_models.py").write_text("class Net:\n    pass\n", encoding="utf-8")
    out = run_python(
        """
        import json, logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        from ort_autopatch.hook import ImportHook, Selector
        classes = []
        ImportHook(Selector(["plain_models:Net"], []), classes.append).install()
        import plain_models
        print(json.dumps({"classes": len(classes), "torch": "torch" in sys.modules}))
        """,
        tmp_path,
    )
    lines = out.strip().splitlines()
    assert json.loads(lines[-1]) == {"classes": 0, "torch": False}
    assert "plain_models:Net matches the allowlist but is not a torch.nn.Module" in out


def test_two_threads_importing_each_others_modules_do_not_deadlock(
    tmp_path: pathlib.Path,
) -> None:
    package = tmp_path / "dl_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    body = (
        "import time, torch\ntime.sleep(0.2)\n{imports}\nclass {cls}(torch.nn.Module):\n    pass\n"
    )
    (package / "a.py").write_text(body.format(imports="import dl_pkg.b", cls="A"), "utf-8")
    (package / "b.py").write_text(body.format(imports="import dl_pkg.c", cls="B"), "utf-8")
    (package / "c.py").write_text(body.format(imports="", cls="C"), "utf-8")
    out = run_python(
        """
        import importlib, threading, time
        import torch
        from ort_autopatch.hook import ImportHook, Selector
        classes, lock = [], threading.Lock()
        def on_class(cls):
            time.sleep(0.05)  # widen the window in which another thread imports
            with lock:
                classes.append(cls.__qualname__)
        ImportHook(Selector(["dl_pkg.*:*"], []), on_class).install()
        errors = []
        def load(name):
            try:
                importlib.import_module(name)
            except BaseException as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=load, args=(n,), daemon=True)
                   for n in ("dl_pkg.a", "dl_pkg.b", "dl_pkg.c")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads), "deadlock: an import never finished"
        assert not errors, errors
        print(",".join(sorted(classes)))
        """,
        tmp_path,
    )
    assert out.strip() == "A,B,C"


def test_thread_started_during_package_init_can_import_its_submodule(
    tmp_path: pathlib.Path,
) -> None:
    # The dd-trace-py deadlock: a package's __init__ starts a thread that imports a submodule and
    # waits for it. importlib.util.find_spec inside find_spec would wait for the package's import
    # lock, which the waiting main thread holds.
    package = tmp_path / "init_thread_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            import importlib, threading, torch
            class Root(torch.nn.Module):
                pass
            _worker = threading.Thread(
                target=importlib.import_module, args=("init_thread_pkg.worker",), daemon=True
            )
            _worker.start()
            _worker.join(timeout=10)
            WORKER_FINISHED = not _worker.is_alive()
            """
        ),
        "utf-8",
    )
    (package / "worker.py").write_text(textwrap.dedent(MODELS), "utf-8")
    out = run_python(
        """
        import torch
        from ort_autopatch.hook import ImportHook, Selector
        classes = []
        ImportHook(Selector(["init_thread_pkg*:*"], []), classes.append).install()
        import init_thread_pkg
        assert init_thread_pkg.WORKER_FINISHED, "deadlock: the worker thread never finished"
        print(",".join(sorted(c.__qualname__ for c in classes)))
        """,
        tmp_path,
    )
    assert out.strip() == "Head,Net,Root"
