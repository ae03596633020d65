"""Which input sizes a graph serves: its size guards, and the graphs of one key by their guards.

A backend that traces with symbolic sizes (the plain backend) gets from the trace the
conditions the graph relies on (`x.shape[0] > 4`, two inputs with one batch size, a dimension
of at least 2): `SizeGuards` keeps them as plain text over `inputs[i].shape[d]`, validated
to be integer arithmetic and comparisons only (what the persistent cache stores is parsed and
checked again, never run as it stands), plus the exact sizes of every dimension traced as a
constant. A graph traced for one input shape has only those.

`SizeClasses` files the graphs of one call key (everything but the sizes) by their guards: a
call is admitted to the first graph whose guards hold for its shapes (graphs traced for one
shape before symbolic ones, which run slower: a TransformerEncoderLayer step took 0.96x
eager's time against 0.72x), so a graph never serves sizes it does not fit; when none holds,
the first failing guard of the graph last used is the rebuild reason. It also decides which
dimensions the next graph traces as symbols: the first graph of a key is traced for its
shapes, and from the second distinct shape on every dimension that has varied is symbolic
(as torch.compile's automatic dynamic shapes). A shape that keeps coming back still earns a
graph traced for it (`callkey.HotShapes`).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

Shapes = tuple[tuple[int, ...], ...]
#: per input, the dimensions traced as symbols
Dims = tuple[tuple[int, ...], ...]

_SIZE = re.compile(r"inputs\[(\d+)\]\.shape\[(\d+)\]")
_OPS = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.FloorDiv,
    ast.Mod,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
)

#: the functions a guard may call (on integers only: their arguments are walked as the rest)
_CALLS = {"min": min, "max": max}


def check_text(text: str, ranks: tuple[int, ...]) -> None:
    """Raise ValueError unless `text` is integer arithmetic (with `min` and `max`) and
    comparisons over `inputs[i].shape[d]` of existing inputs and dimensions."""

    def size(node: ast.AST) -> bool:
        # inputs[i].shape[d]
        if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)):
            return False
        owner = node.value.value
        if not (
            node.value.attr == "shape"
            and isinstance(owner, ast.Subscript)
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "inputs"
        ):
            return False
        i, d = owner.slice, node.slice
        if not (isinstance(i, ast.Constant) and isinstance(d, ast.Constant)):
            return False
        if type(i.value) is not int or type(d.value) is not int:
            return False
        if not (0 <= i.value < len(ranks) and 0 <= d.value < ranks[i.value]):
            raise ValueError(f"{text!r} names a dimension the inputs do not have")
        return True

    def walk(node: ast.AST) -> None:
        if size(node):
            return
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, bool):
                raise ValueError(f"{text!r} has a constant that is not an integer")
            return
        if isinstance(node, ast.Call):
            # min/max of sizes: a diagonal's length (x.diagonal(1) of (r, c): min(r, c - 1))
            if not (
                isinstance(node.func, ast.Name)
                and node.func.id in _CALLS
                and len(node.args) >= 2
                and not node.keywords
            ):
                raise ValueError(f"{text!r} calls what a size guard may not")
            for argument in node.args:
                walk(argument)
            return
        if not isinstance(node, _OPS):
            raise ValueError(f"{text!r} has {type(node).__name__}, which a size guard may not")
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(ast.parse(text, mode="eval"))


def _compile(texts: list[str]) -> Callable[[Shapes], bool]:
    """A predicate over the call's shapes (texts already checked by `check_text`)."""
    body = " and ".join("(" + _SIZE.sub(r"S[\1][\2]", t) + ")" for t in texts) or "True"
    predicate: Callable[[Shapes], bool] = eval(f"lambda S: {body}", {"__builtins__": {}, **_CALLS})
    return predicate


@dataclass(frozen=True)
class SizeGuards:
    """The input sizes one graph serves: `traced` exactly, except the `dynamic` dimensions,
    which are free within `texts` (the trace's guards)."""

    traced: Shapes  # the shapes of the call that built the graph
    dynamic: Dims = ()  # per input, the dimensions traced as symbols (empty: none)
    texts: tuple[str, ...] = ()  # guards over inputs[i].shape[d], for the dynamic dims
    _admits: Callable[[Shapes], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.is_dynamic:
            object.__setattr__(self, "_admits", self.traced.__eq__)
            return
        ranks = tuple(len(s) for s in self.traced)
        for text in self.texts:
            check_text(text, ranks)
        object.__setattr__(self, "_admits", _compile([*self._static_texts(), *self.texts]))
        if not self._admits(self.traced):
            raise ValueError("the guards do not hold for the traced shapes")

    @property
    def is_dynamic(self) -> bool:
        return any(self.dynamic)

    @property
    def token(self) -> Hashable:
        """What a call key holds for this graph: its shapes, or its guards."""
        if not self.is_dynamic:
            return self.traced
        return ("size guards", self._static_texts(), self.texts)

    def pattern(self) -> Shapes:
        """The traced shapes with the dynamic dimensions as -1 (the persistent key's)."""
        return tuple(
            tuple(-1 if d in dims else n for d, n in enumerate(shape))
            for shape, dims in zip(self.traced, self._dims(), strict=True)
        )

    def admits(self, shapes: Shapes) -> bool:
        try:
            return bool(self._admits(shapes))
        except (IndexError, TypeError, ZeroDivisionError):
            return False

    def first_failure(self, shapes: Shapes) -> str | None:
        """The first guard that does not hold for `shapes` (None: all hold)."""
        for text in [*self._static_texts(), *self.texts]:
            try:
                holds = _compile([text])(shapes)
            except (IndexError, TypeError, ZeroDivisionError):
                holds = False
            if not holds:
                return text
        return None

    def meta(self) -> dict[str, Any]:
        return {
            "traced": [list(s) for s in self.traced],
            "dynamic": [list(d) for d in self.dynamic],
            "texts": list(self.texts),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> SizeGuards:
        """Read back (and checked again: a stored text is parsed, never trusted)."""
        return cls(
            traced=tuple(tuple(int(n) for n in s) for s in meta["traced"]),
            dynamic=tuple(tuple(int(d) for d in dims) for dims in meta["dynamic"]),
            texts=tuple(str(t) for t in meta["texts"]),
        )

    def _dims(self) -> Dims:
        return self.dynamic or tuple(() for _ in self.traced)

    def _static_texts(self) -> tuple[str, ...]:
        return tuple(
            f"inputs[{i}].shape[{d}] == {n}"
            for i, (shape, dims) in enumerate(zip(self.traced, self._dims(), strict=True))
            for d, n in enumerate(shape)
            if d not in dims
        )


class SizeClasses:
    """The graphs of each call key (without sizes) by their size guards, and which dimensions
    have varied between the calls that built them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # base key -> [(guards, key)] in the order built; replaced, never mutated
        self._families: dict[Hashable, list[tuple[SizeGuards, Any]]] = {}
        self._guards: dict[Any, SizeGuards] = {}  # family key -> its guards
        self._last: dict[Hashable, SizeGuards] = {}  # base key -> the guards last admitting
        self._seen: dict[Hashable, Shapes] = {}  # base key -> the first shapes built for
        self._varied: dict[Hashable, set[tuple[int, int]]] = {}  # base -> (input, dim)
        # base -> why symbolic traces fail for it (a size read as a Python value, and where)
        self._static_only: dict[Hashable, str] = {}
        self._exact: dict[tuple[Hashable, Shapes], Any] = {}  # see `exact`

    def classify(self, base: Any, shapes: Shapes, held: Callable[[Any], bool]) -> Any | None:
        """The key of the first graph of `base` whose guards admit `shapes`, or None. A
        graph no longer `held` (evicted) is forgotten."""
        families = self._families.get(base)
        if not families:
            return None
        for guards, key in families:
            if guards.admits(shapes):
                if held(key):
                    self._last[base] = guards
                    return key
                self._drop(base, key)
        return None

    def admits(self, key: Any, shapes: Shapes) -> bool:
        """Whether the graph filed under `key` serves `shapes`."""
        guards = self._guards.get(key)
        return guards is not None and guards.admits(shapes)

    def reason(self, base: Any, shapes: Shapes) -> str | None:
        """Why no graph of `base` admits `shapes`: the model's code that reads sizes as
        Python values, once symbolic traces of `base` fail for it, else the failing guard of
        the graph last used."""
        cause = self._static_only.get(base)
        if cause:
            return cause
        guards = self._last.get(base)
        if guards is None:
            families = self._families.get(base)
            if not families:
                return None
            guards = families[-1][0]
        failed = guards.first_failure(shapes)
        return None if failed is None else f"size guard failed: {failed}"

    def key_of(self, base: Any, guards: SizeGuards) -> Any:
        return dataclasses.replace(base, shapes=guards.token)

    def exact(self, base: Any, shapes: Shapes) -> Any:
        """The key of the graph traced for exactly `shapes` (a shape that earned its graph,
        asked on each of its calls: one key object per base and shapes)."""
        found = self._exact.get((base, shapes))
        if found is None:
            found = self._exact[(base, shapes)] = self.key_of(base, SizeGuards(shapes))
        return found

    def add(self, base: Any, guards: SizeGuards) -> Any:
        """File a graph built for `base` with `guards`; its key."""
        key = self.key_of(base, guards)
        with self._lock:
            # the first shapes of `base` as the build filed it: a build may teach the guards
            # attributes, so the base the call asked `dynamic_dims` for had none of them
            self._seen.setdefault(base, guards.traced)
            kept = [(g, k) for g, k in self._families.get(base, []) if k != key]
            # graphs for one shape first: faster than a symbolic one where both admit a call
            exact = [(g, k) for g, k in kept if not g.is_dynamic]
            symbolic = [(g, k) for g, k in kept if g.is_dynamic]
            if guards.is_dynamic:
                symbolic.append((guards, key))
            else:
                exact.append((guards, key))
            self._families[base] = [*exact, *symbolic]
            self._guards[key] = guards
            self._last[base] = guards
        return key

    def dynamic_dims(self, base: Any, shapes: Shapes) -> Dims | None:
        """Which dimensions the graph for `shapes` traces as symbols: those that differ from
        the first shapes built for `base` or have differed before; None for the first graph,
        for shapes seen before and after symbolic traces failed for `base`."""
        with self._lock:
            first = self._seen.setdefault(base, shapes)
            varied = self._varied.setdefault(base, set())
            for i, (a, b) in enumerate(zip(first, shapes, strict=False)):
                varied.update((i, d) for d, (m, n) in enumerate(zip(a, b, strict=False)) if m != n)
            if base in self._static_only:
                return None
            # torch fixes a symbol whose example size is 0 or 1: such a call gets a graph
            # for its shapes, and the key keeps its symbolic graphs for the others
            dims = tuple(
                tuple(d for d, n in enumerate(shape) if (i, d) in varied and n > 1)
                for i, shape in enumerate(shapes)
            )
            return dims if any(dims) else None

    def static_only(self, base: Any, cause: str = "") -> None:
        """Symbolic traces fail (or specialise) for `base`: one graph per shape from now on;
        `cause` is the rebuild reason of its later graphs."""
        with self._lock:
            self._static_only.setdefault(base, cause)

    def per_shape(self, base: Any) -> bool:
        """Whether `base` gets one graph per input shape (its symbolic traces failed)."""
        return base in self._static_only

    def clear(self) -> None:
        with self._lock:
            self._families.clear()
            self._guards.clear()
            self._last.clear()
            self._exact.clear()

    def _drop(self, base: Any, key: Any) -> None:
        with self._lock:
            self._families[base] = [(g, k) for g, k in self._families.get(base, []) if k != key]
            self._guards.pop(key, None)
