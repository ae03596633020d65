"""Keys and (de)serialisation of recipes for the persistent graph cache and saved graphs."""

from __future__ import annotations

import hashlib
import inspect
import logging
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ort_autopatch.engine import calls, hazards, runtime
from ort_autopatch.engine.backend import Backend
from ort_autopatch.engine.callkey import CallKey, Guards
from ort_autopatch.engine.recipe import Recipe
from ort_autopatch.engine.signature import FlatCall
from ort_autopatch.engine.sizes import SizeGuards
from ort_autopatch.engine.state import ModuleState
from ort_autopatch.engine.store import GraphStore, StoredEntry, digest, digest_bytes

log = logging.getLogger("ort_autopatch")

_MISSING = "<missing>"
_JSON_LEAVES = (type(None), bool, int, float, str)


def static_key(
    *,
    cls: str,
    backend: str,
    graph_version: str,
    sources: str,
    state: ModuleState,
    key: dict[str, Any],
    device: torch.device,
    opset: int,
) -> str:
    """Everything that decides a graph except attribute values forward read: the call key's
    persistent part (`CallKey.persistent`) and the module's tensor layout."""
    from ort_autopatch.versions import __version__

    return digest(
        {
            "tool": __version__,
            "graphs": graph_version,
            "torch": torch.__version__,
            "onnxruntime": runtime.version(),
            "backend": backend,
            "class": cls,
            "sources": sources,
            "state": [
                (name, tuple(t.shape), str(t.dtype))
                for name, t in zip(state.names, state.tensors, strict=True)
            ],
            "key": key,
            "device": device.type,
            "machine": machine_fingerprint(),
            "opset": opset,
        }
    )


_fingerprint: str | None = None


def machine_fingerprint() -> str:
    """ORT's optimised graphs use this CPU's features; another machine must not load them."""
    global _fingerprint
    if _fingerprint is None:
        flags = ""
        try:
            with open("/proc/cpuinfo") as info:
                flags = next((ln for ln in info if ln.startswith(("flags", "Features"))), "")
        except OSError:
            pass
        # (platform.processor() would run `uname -p` in a subprocess on every first build)
        _fingerprint = digest([platform.machine(), flags])
    return _fingerprint


def graphs_of(recipe: Recipe) -> dict[str, bytes]:
    return {"forward": recipe.forward_model, **recipe.payload.graphs()}


def resolve(root: Any, path: str) -> Any:
    value = root
    for part in path.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def full_key(static: str, root: torch.nn.Module, paths: list[str]) -> str:
    return digest([static, [(p, stable_repr(resolve(root, p))) for p in paths]])


def stable_repr(value: Any) -> str:
    """A text for a value that is the same in every process (no memory addresses)."""
    if isinstance(value, (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(stable_repr(v) for v in value)})"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{stable_repr(k)}: {stable_repr(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().view(-1).view(torch.uint8)
        return (
            f"tensor({value.dtype}, {tuple(value.shape)}, {digest_bytes(data.numpy().tobytes())})"
        )
    if inspect.ismethod(value):
        return f"method({_qualified(type(value.__self__))}.{value.__func__.__name__})"
    if callable(value) and hasattr(value, "__qualname__"):
        return _qualified(value)
    if type(value).__repr__ is object.__repr__:
        return f"<{_qualified(type(value))}>"
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def _qualified(obj: Any) -> str:
    return (
        f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    )


def meta_of(recipe: Recipe) -> dict[str, Any] | None:
    """The recipe as JSON, or None when its output structure cannot be written as JSON."""
    spec = recipe.output_spec
    if not all(isinstance(leaf, _JSON_LEAVES) for leaf in spec.leaves):
        return None
    try:
        treespec = pytree.treespec_dumps(spec.spec)
    except Exception:  # types registered without a serialized name, e.g. custom containers
        return None
    return {
        "backend": recipe.backend,
        "has_backward": recipe.has_backward,
        "feed_sources": {k: list(v) for k, v in recipe.feed_sources.items()},
        "num_user_outputs": recipe.num_user_outputs,
        "output_treespec": treespec,
        "output_leaves": spec.leaves,
        "output_positions": spec.tensor_positions,
        "batch_norms": [list(b) for b in recipe.batch_norms],
        "seeds_dropout": recipe.seeds_dropout,
        "redraws": recipe.redraws,
        "checks": [
            {
                "expected": c.expected,
                "kind": c.hazard.kind,
                "what": c.hazard.what,
                "where": c.hazard.where,
            }
            for c in recipe.checks
        ],
        "traced_shapes": None
        if recipe.traced_shapes is None
        else [list(shape) for shape in recipe.traced_shapes],
        "size_guards": None if recipe.size_guards is None else recipe.size_guards.meta(),
        "torch_nodes": recipe.torch_nodes,
        "payload": recipe.payload.meta(),
    }


def recipe_from(stored: StoredEntry, cls: str, backend: type[Backend]) -> Recipe | None:
    """A recipe from a stored entry, or None (with a warning) when the entry does not fit."""
    meta = stored.meta
    try:
        spec = calls.OutputSpec(
            pytree.treespec_loads(meta["output_treespec"]),
            list(meta["output_leaves"]),
            [int(p) for p in meta["output_positions"]],
        )
        if meta["backend"] != backend.name:
            raise ValueError(f"built by {meta['backend']}, not {backend.name}")
        return Recipe(
            backend=backend.name,
            has_backward=bool(meta["has_backward"]),
            forward_model=stored.graphs["forward"],
            payload=backend.payload_from(meta["payload"], stored.graphs),
            feed_sources={k: (str(v[0]), v[1]) for k, v in meta["feed_sources"].items()},
            num_user_outputs=int(meta["num_user_outputs"]),
            output_spec=spec,
            batch_norms=[(str(b[0]), int(b[1]), int(b[2])) for b in meta["batch_norms"]],
            seeds_dropout=bool(meta["seeds_dropout"]),
            redraws=bool(meta.get("redraws", True)),  # unknown: assume it cannot repeat
            checks=[
                hazards.Check(c["expected"], hazards.Hazard(c["kind"], c["what"], c["where"]))
                for c in meta.get("checks", [])
            ],
            traced_shapes=None
            if meta.get("traced_shapes") is None
            else tuple(tuple(int(d) for d in shape) for shape in meta["traced_shapes"]),
            size_guards=None
            if meta.get("size_guards") is None
            else SizeGuards.from_meta(meta["size_guards"]),
            torch_nodes={str(k): int(v) for k, v in meta.get("torch_nodes", {}).items()},
        )
    except Exception as exc:
        log.warning(
            "ort_autopatch: %s: ignoring a cached graph that does not fit (%s); rebuilding",
            cls,
            exc,
        )
        return None


def save_onnx(
    folder: Path,
    cls: str,
    has_backward: bool,
    train_flag: bool,
    key: str,
    forward: bytes,
    others: dict[str, bytes],
) -> None:
    """Write the exported forward graph (`{stem}.onnx`) and the backend's others
    (`{stem}.{role}.onnx`) with a name saying class, mode and signature."""
    mode = "train" if has_backward else ("nograd" if train_flag else "eval")
    stem = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', cls)}-{mode}-{key[:12]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if forward:  # none for a graph cut at torch nodes: its segments are among the others
            (folder / f"{stem}.onnx").write_bytes(forward)
        for role, model in others.items():
            (folder / f"{stem}.{role}.onnx").write_bytes(model)
    except OSError as exc:
        log.warning("ort_autopatch: cannot save graphs to %s: %s", folder, exc)


_stores: dict[Path, GraphStore] = {}


def store_for(root: Path | None) -> GraphStore | None:
    """The one store of a cache folder in this process, or None without a usable one."""
    if root is None:
        return None
    store = _stores.get(root)
    if store is None:
        store = _stores[root] = GraphStore(root)
    return store if store.usable else None


_source_cache: dict[tuple[str, float], str] = {}


def source_digest(module: torch.nn.Module) -> str | None:
    """Hash of the files defining every class in the tree: an edited model never loads a
    graph exported from its old code. None when a class has no source file (REPL, exec)."""
    files = set()
    for sub in module.modules():
        for klass in type(sub).__mro__:
            if klass.__module__ in ("builtins", "torch.nn.modules.module"):
                continue
            mod = sys.modules.get(klass.__module__)
            path = getattr(mod, "__file__", None)
            if path is None:
                return None
            files.add(path)
    hashed = hashlib.sha256()
    for path in sorted(files):
        try:
            stamp = Path(path).stat().st_mtime
            cached = _source_cache.get((path, stamp))
            if cached is None:
                cached = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                _source_cache[(path, stamp)] = cached
        except OSError:
            return None
        hashed.update(path.encode() + cached.encode())
    return hashed.hexdigest()


class Persistence:
    """One module's way to the on-disk graph cache (`--cache-dir`) and to `--save-onnx`."""

    def __init__(
        self,
        cls: str,
        backend: type[Backend],
        store: GraphStore | None,
        save_onnx: Path | None,
        opset: int,
        guards: Guards | None,
    ) -> None:
        self.cls = cls
        self.backend = backend
        self.store = store
        self.save_to = save_onnx
        self.opset = opset
        self.guards = guards

    def with_store(self, store: GraphStore) -> Persistence:
        """The same, storing in `store`."""
        return Persistence(self.cls, self.backend, store, self.save_to, self.opset, self.guards)

    @property
    def enabled(self) -> bool:
        """Whether a build needs its on-disk key (to load, store or name saved graphs)."""
        return self.store is not None or self.save_to is not None

    def key(
        self, module: torch.nn.Module, state: ModuleState, call_key: CallKey, device: torch.device
    ) -> str | None:
        """The static part of the on-disk key; None without a store, or when a class of the
        tree has no source file to hash (REPL, exec)."""
        if not self.enabled:
            return None
        sources = source_digest(module)
        if sources is None:
            return None
        return static_key(
            cls=self.cls,
            backend=self.backend.name,
            graph_version=self.backend.graph_version(),
            sources=sources,
            state=state,
            key=call_key.persistent(),
            device=device,
            opset=self.opset,
        )

    def load(self, static: str, module: torch.nn.Module) -> Recipe | None:
        if self.store is None:
            return None
        paths = self.store.paths(static)
        stored = self.store.load(static, full_key(static, module, paths))
        if stored is None:
            return None
        recipe = recipe_from(stored, self.cls, self.backend)
        if recipe is None:
            return None
        if self.guards is not None:
            self.guards.adopt(module, paths)
        return recipe

    def save(
        self,
        module: torch.nn.Module,
        recipe: Recipe,
        ran: dict[str, bytes],
        call: FlatCall,
        static: str | None,
        base_key: str | None,
    ) -> None:
        """Store a built recipe (`static`: its key now, `base_key`: its key when the build
        started, None when either had none) and write the graphs its sessions run (`ran`: role
        -> graph, besides the forward) to `--save-onnx`."""
        # torch-calling nodes may name callables of this process only: such graphs cannot
        # be loaded by another (`Payload.restores_torch_nodes`)
        persistable = not recipe.torch_nodes or recipe.payload.restores_torch_nodes()
        if persistable and self.store is not None and static is not None and base_key is not None:
            paths = self.guards.paths() if self.guards is not None else []
            known = self.store.paths(static)
            union = known + [p for p in paths if p not in known]
            meta = meta_of(recipe)
            if meta is not None:
                self.store.save(
                    static, full_key(static, module, union), meta, graphs_of(recipe), union
                )
        if self.save_to is not None:
            name = static or digest(repr(call.signature))
            save_onnx(
                self.save_to,
                self.cls,
                recipe.has_backward,
                module.training,
                name,
                recipe.forward_model,
                ran,
            )
