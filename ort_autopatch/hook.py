"""Find the selected classes: as their modules load, already loaded, or as they are created.

Three ways in, because a class can appear three ways:

* an import hook (a `sys.meta_path` finder) scans a module right after it executes;
* `install()` scans modules imported before it ran (`from x import C` keeps working because
  the class object itself is handed on, never a name);
* an `__init_subclass__` on `torch.nn.Module` catches classes created in `__main__`, inside
  functions, after their module loaded, and subclasses of patched classes.

Lessons from other tools (docs/architecture.md, "Activation"): the finder answers `None` at once for
modules nothing can match, walks `sys.meta_path` itself instead of calling
`importlib.util.find_spec` (which deadlocked ddtrace), wraps the real loader rather than replacing
it and puts it back on the module, and never lets its own failure break the user's import.
This module never imports torch: it looks torch up in `sys.modules`.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
import re
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from ort_autopatch.errors import ConfigError

if TYPE_CHECKING:  # importlib.abc pulls in importlib.resources: ~20 ms at every startup
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec

__all__ = ["PATCHED_MARKER", "ImportHook", "Selector"]

_log = logging.getLogger("ort_autopatch")

#: Attribute the patcher sets (truthy) on a patched class; subclasses of such classes are selected.
PATCHED_MARKER = "__ort_autopatch_patched__"

_TORCH_MODULE_MODULE = "torch.nn.modules.module"
_WILDCARDS = "*?["
# Spawned multiprocessing children run the parent's script as `__mp_main__`; users write
# `__main__:Net` for it, so both names select the same classes.
_MAIN_ALIASES = {"__mp_main__": "__main__"}
_MISSING = object()


class Selector:
    """Which `module:Class` pairs are selected, by fnmatch patterns; the exclude list wins.

    The class side is matched against `__qualname__` (`Outer.Inner`, `f.<locals>.Net`) and
    against the plain `__name__`. `may_match_module` is on the path of every import in the
    process, so it answers from a cache, a frozenset of exact names and a `startswith` on the
    literal prefixes of wildcard patterns before it ever runs fnmatch.
    """

    def __init__(self, modules: Sequence[str], exclude: Sequence[str]) -> None:
        self._patterns = [_split(p) for p in modules]
        self._excludes = [_split(p) for p in exclude]
        self._pattern_texts = list(modules)
        self._exact = frozenset(mod for mod, _ in self._patterns if not _has_wildcard(mod))
        wild = [mod for mod, _ in self._patterns if _has_wildcard(mod)]
        self._prefixes = tuple({_literal_prefix(mod) for mod in wild})
        self._wild = [_compile(mod) for mod in wild]
        # A module whose every class is excluded needs no scanning at all.
        self._whole_module_excludes = [_compile(mod) for mod, cls in self._excludes if cls == "*"]
        self._compiled_patterns = [(_compile(mod), _compile(cls)) for mod, cls in self._patterns]
        self._compiled_excludes = [(_compile(mod), _compile(cls)) for mod, cls in self._excludes]
        self._module_cache: dict[str, bool] = {}
        self._matched: set[int] = set()
        self._lock = threading.Lock()

    def may_match_module(self, name: str) -> bool:
        """Cheap test: could any class defined in module `name` be selected?"""
        cached = self._module_cache.get(name)
        if cached is None:
            alias = _MAIN_ALIASES.get(name)
            cached = self._module_may_match(name) or (
                alias is not None and self._module_may_match(alias)
            )
            self._module_cache[name] = cached  # a lost race recomputes the same answer
        return cached

    def _module_may_match(self, name: str) -> bool:
        if name in self._exact:
            hit = True
        elif self._prefixes and name.startswith(self._prefixes):
            hit = any(rx.match(name) for rx in self._wild)
        else:
            hit = False
        return hit and not any(rx.match(name) for rx in self._whole_module_excludes)

    def matches(self, module_name: str, qualname: str) -> bool:
        """Whether the class `module_name:qualname` is selected (and not excluded)."""
        if not self.may_match_module(module_name):
            return False
        hits = _hits(self._compiled_patterns, module_name, qualname)
        if not hits:
            return False
        with self._lock:
            self._matched.update(hits)
        return not self.excluded(module_name, qualname)

    def names_exactly(self, module_name: str, qualname: str) -> bool:
        """Whether a pattern spells this class's name out (no wildcard on the class side):
        the user meant this very class, where a wildcard's matches are only candidates."""
        literal = [
            (mod_rx, cls_rx)
            for (mod_rx, cls_rx), (_, cls) in zip(
                self._compiled_patterns, self._patterns, strict=True
            )
            if not _has_wildcard(cls)
        ]
        return bool(literal) and bool(_hits(literal, module_name, qualname, first=True))

    def excluded(self, module_name: str, qualname: str) -> bool:
        """Whether the exclude list names the class `module_name:qualname`."""
        return bool(self._compiled_excludes) and bool(
            _hits(self._compiled_excludes, module_name, qualname, first=True)
        )

    def unmatched(self) -> list[str]:
        """Allowlist patterns that have not matched any class so far, for the exit report.

        A class the exclude list removes still counts as a match (the pattern is not a typo),
        except in modules excluded as a whole (`mod:*`), which are never looked at.
        """
        with self._lock:
            matched = set(self._matched)
        return [text for i, text in enumerate(self._pattern_texts) if i not in matched]


def _hits(
    patterns: Sequence[tuple[re.Pattern[str], re.Pattern[str]]],
    module_name: str,
    qualname: str,
    first: bool = False,
) -> list[int]:
    """Indexes of the patterns matching the class (only the first one if `first`)."""
    modules = (module_name, _MAIN_ALIASES.get(module_name, module_name))
    name = qualname.rpartition(".")[2]
    hits = []
    for index, (mod_rx, cls_rx) in enumerate(patterns):
        if any(mod_rx.match(m) for m in modules) and (cls_rx.match(qualname) or cls_rx.match(name)):
            hits.append(index)
            if first:
                break
    return hits


def _split(pattern: str) -> tuple[str, str]:
    module, colon, cls = pattern.strip().partition(":")
    if not colon or not module or not cls or ":" in cls:
        raise ConfigError(
            "selector pattern", pattern, "not 'module.path:Class'", "'module.path:Class'"
        )
    return module, cls


def _has_wildcard(text: str) -> bool:
    return any(ch in text for ch in _WILDCARDS)


def _literal_prefix(text: str) -> str:
    cut = min((i for i, ch in enumerate(text) if ch in _WILDCARDS), default=len(text))
    return text[:cut]


_compiled: dict[str, re.Pattern[str]] = {}


def _compile(pattern: str) -> re.Pattern[str]:
    """fnmatch, case-sensitive on every OS (Python names are), compiled once per pattern."""
    rx = _compiled.get(pattern)
    if rx is None:
        rx = _compiled[pattern] = re.compile(fnmatch.translate(pattern))
    return rx


class ImportHook:
    """Calls `on_class(cls)` once for every selected class object, however it comes to exist.

    `on_class` (the patcher) runs while the class's module is being imported, or inside
    `__init_subclass__`; its exceptions are logged, never raised into the user's code.
    """

    def __init__(
        self,
        selector: Selector,
        on_class: Callable[[type], None],
        after_import: dict[str, Callable[[ModuleType], None]] | None = None,
    ) -> None:
        self.selector = selector
        self._on_class = on_class
        # module name -> called with the module once it has loaded (or at install, if it has)
        self._after_import = dict(after_import or {})
        self._finder = _Finder(self)
        self._lock = threading.RLock()
        self._installed = False
        self._seen: weakref.WeakSet[type] = weakref.WeakSet()
        self._seen_lock = threading.Lock()
        self._warned: set[str] = set()  # "module:qualname" of non-Module classes (warn once)
        self._torch_pending = False  # waiting for torch.nn.modules.module to finish loading
        self._module_cls: type | None = None  # the torch.nn.Module we put __init_subclass__ on
        self._previous_init_subclass: Any = _MISSING
        self._our_init_subclass: Any = None

    def install(self) -> None:
        """Put the finder first on `sys.meta_path`, hook torch, and scan what is loaded."""
        with self._lock:
            if self._installed:
                _log.debug("ort_autopatch import hook already installed; nothing to do")
                return
            self._installed = True
            sys.meta_path.insert(0, self._finder)
            if not self._install_subclass_hook():
                self._torch_pending = True
        for name in list(self._after_import):
            loaded = sys.modules.get(name)
            if loaded is not None:
                self._loaded_watched(name, loaded)
        for name, module in list(sys.modules.items()):
            if (
                isinstance(name, str)
                and module is not None
                and self.selector.may_match_module(name)
            ):
                self._scan(name, module)

    def uninstall(self) -> None:
        """Remove the finder and restore `torch.nn.Module.__init_subclass__` exactly."""
        with self._lock:
            if not self._installed:
                return
            self._installed = False
            self._torch_pending = False
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self._finder]
            self._uninstall_subclass_hook()

    # --- torch.nn.Module.__init_subclass__ -------------------------------------------------

    def _install_subclass_hook(self) -> bool:
        """Chain our `__init_subclass__` onto torch.nn.Module; False if torch is not loaded."""
        torch_module = sys.modules.get(_TORCH_MODULE_MODULE)
        module_cls = getattr(torch_module, "Module", None)
        if not isinstance(module_cls, type):
            return False
        previous = module_cls.__dict__.get("__init_subclass__", _MISSING)
        hook = self
        owner: type = module_cls

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            if previous is _MISSING:
                # mypy cannot type super() outside a class body; this is Module's own super().
                super(owner, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
            else:
                previous.__get__(None, cls)(**kwargs)
            if hook._installed:
                hook._class_created(cls)

        __init_subclass__.__qualname__ = f"{module_cls.__qualname__}.__init_subclass__"
        ours: Any = classmethod(__init_subclass__)
        type.__setattr__(module_cls, "__init_subclass__", ours)
        self._module_cls = module_cls
        self._previous_init_subclass = previous
        self._our_init_subclass = ours
        self._torch_pending = False
        _log.debug("ort_autopatch hooked %s.__init_subclass__", module_cls.__qualname__)
        return True

    def _uninstall_subclass_hook(self) -> None:
        module_cls = self._module_cls
        if module_cls is None:
            return
        self._module_cls = None
        if module_cls.__dict__.get("__init_subclass__") is not self._our_init_subclass:
            # Someone chained onto ours; removing it would drop theirs. Ours stays as a
            # pass-through (it checks `_installed`), which is all that can be done safely.
            _log.debug("torch.nn.Module.__init_subclass__ was rewrapped; leaving it in place")
            return
        if self._previous_init_subclass is _MISSING:
            type.__delattr__(module_cls, "__init_subclass__")
        else:
            type.__setattr__(module_cls, "__init_subclass__", self._previous_init_subclass)

    def _class_created(self, cls: type) -> None:
        try:
            module_name, qualname = cls.__module__, cls.__qualname__
            if self.selector.matches(module_name, qualname) or (
                any(getattr(base, PATCHED_MARKER, False) for base in cls.__bases__)
                and not self.selector.excluded(module_name, qualname)
                # torch's own dynamic subclasses (FSDP2's FSDPBlock for Block) inherit the
                # patch and count for the class the user selected
                and not module_name.startswith("torch.")
            ):
                self._deliver(cls)
        except Exception:
            _log.error("ort_autopatch could not handle new class %r", cls, exc_info=True)

    # --- modules ---------------------------------------------------------------------------

    def _module_loaded(self, name: str, module: ModuleType) -> None:
        """Called by the wrapped loader after the module body ran without error."""
        if not self._installed:
            return
        try:
            if name == _TORCH_MODULE_MODULE and self._torch_pending:
                with self._lock:
                    if self._installed and self._torch_pending:
                        self._install_subclass_hook()
            # The module may have replaced itself in sys.modules while it ran.
            current = sys.modules.get(name, module)
            if name in self._after_import:
                self._loaded_watched(name, current)
            if self.selector.may_match_module(name):
                self._scan(name, current)
        except Exception:
            _log.error("ort_autopatch failed after importing %s", name, exc_info=True)

    def _loaded_watched(self, name: str, module: ModuleType) -> None:
        callback = self._after_import.pop(name, None)
        if callback is not None:
            try:
                callback(module)
            except Exception:
                _log.error("ort_autopatch failed after importing %s", name, exc_info=True)

    def _scan(self, name: str, module: object) -> None:
        """Hand every selected class defined in `module` (nested ones too) to on_class."""
        try:
            namespace = dict(vars(module))
        except TypeError:
            return
        todo = [obj for obj in namespace.values() if isinstance(obj, type)]
        for cls in todo:  # grows while iterating; keeps definition order, outer before inner
            try:
                if getattr(cls, "__module__", None) != name:
                    continue
                qualname = cls.__qualname__
                if self.selector.matches(name, qualname):
                    self._deliver(cls)
                # Nested classes: qualnames only grow, so this cannot loop.
                todo.extend(
                    inner
                    for inner in list(vars(cls).values())
                    if isinstance(inner, type)
                    and getattr(inner, "__qualname__", "").startswith(qualname + ".")
                )
            except Exception:
                _log.error("ort_autopatch could not handle %s.%r", name, cls, exc_info=True)

    def _deliver(self, cls: type) -> None:
        with self._seen_lock:
            if cls in self._seen:
                return
            self._seen.add(cls)
        if not _is_torch_module(cls):
            # A wildcard over a module selects its classes of every kind ('torchvision.models.*:*'
            # meets 140 weight enums and helpers): only a class named outright is a mistake.
            label = f"{cls.__module__}:{cls.__qualname__}"
            named = self.selector.names_exactly(cls.__module__, cls.__qualname__)
            with self._seen_lock:
                first = named and label not in self._warned
                self._warned.add(label)
            if first:  # once per name, so reloading a module does not repeat it
                _log.warning(
                    "ort_autopatch: %s matches the allowlist but is not a torch.nn.Module "
                    "subclass; skipped",
                    label,
                )
            return
        try:
            self._on_class(cls)
        except Exception:
            _log.error(
                "ort_autopatch could not patch %s:%s; it runs unchanged",
                cls.__module__,
                cls.__qualname__,
                exc_info=True,
            )


def _is_torch_module(cls: type) -> bool:
    # If torch is not loaded, nothing can subclass its Module: never import it from here.
    module_cls = getattr(sys.modules.get(_TORCH_MODULE_MODULE), "Module", None)
    if not isinstance(module_cls, type):
        module_cls = getattr(sys.modules.get("torch.nn"), "Module", None)
    return isinstance(module_cls, type) and issubclass(cls, module_cls)


class _Finder:
    """The `sys.meta_path` entry: finds nothing itself, only wraps loaders of watched modules."""

    def __init__(self, hook: ImportHook) -> None:
        self._hook = hook
        self._local = threading.local()  # names this thread is looking up through us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        hook = self._hook
        if (
            not hook.selector.may_match_module(fullname)
            and not (hook._torch_pending and fullname == _TORCH_MODULE_MODULE)
            and fullname not in hook._after_import
        ):
            return None
        busy: set[str] | None = getattr(self._local, "busy", None)
        if busy is None:
            busy = self._local.busy = set()
        if fullname in busy:
            return None  # another finder called back into the import system for this name
        busy.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None:
            return spec  # not found, or a namespace package: nothing to execute, nothing to scan
        loader = spec.loader
        if not hasattr(loader, "exec_module") or isinstance(loader, importlib.util.LazyLoader):
            # Legacy load_module loaders, and lazy modules (scanning would load them now),
            # are left to the __init_subclass__ hook.
            return spec
        spec.loader = cast("Loader", _ScanningLoader(loader, hook))
        return spec

    def _find_elsewhere(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        # The same walk as importlib._bootstrap._find_spec, minus the import lock and the
        # parent-package import that importlib.util.find_spec would do (the deadlock).
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                # A legacy finder claims names its own way; let the import system handle it.
                _log.debug("ort_autopatch: legacy finder %r; %s not hooked", finder, fullname)
                return None
            spec: ModuleSpec | None = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


class _ScanningLoader:
    """Delegates to the real loader; after the module body ran, hands its classes to the hook."""

    def __init__(self, loader: Any, hook: ImportHook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back before the body runs, so the module (and anything that
        # inspects it later: pickle, inspect, importlib.resources, reload) never sees us.
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        name = spec.name if spec is not None else module.__name__
        self._loader.exec_module(module)  # the user's exceptions propagate unchanged
        self._hook._module_loaded(name, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __repr__(self) -> str:
        return f"<ort_autopatch scanning loader for {self._loader!r}>"
