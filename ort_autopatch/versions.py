"""This tool's version; which torch it is tested with, and whether the installed one is such
a version.

The engine exports through torch's TorchScript ONNX exporter and some of its private modules
(`torch.onnx._internal.torchscript_exporter`), which change between torch releases; a torch
outside the tested range could export a graph that differs from eager without failing. So an
untested torch runs the script eagerly, saying why, unless the user opts in. Reads package
metadata only: nothing is imported.
"""

from __future__ import annotations

from importlib import metadata

#: this tool's version (pyproject.toml's); `ort_autopatch.__version__` re-exports it
__version__ = "0.1.0"

#: torch releases (major, minor) the test suite runs on, oldest first and without gaps; keep
#: pyproject.toml's range equal (README's compatibility table says what ran on which).
TESTED_TORCH = ((2, 13), (2, 14), (2, 15))


def tested_range() -> str:
    """The tested releases in words: `2.13.x to 2.15.x`."""
    (major, first), (_, last) = TESTED_TORCH[0], TESTED_TORCH[-1]
    if first == last:
        return f"{major}.{first}.x"
    return f"{major}.{first}.x to {major}.{last}.x"


def installed_torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def untested_torch_reason(version: str | None) -> str | None:
    """Why `version` of torch is not one this tool is tested with, or None if it is."""
    tested = tested_range()
    if version is None:
        return "torch is not installed"
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"cannot read torch's version {version!r}"
    if (major, minor) in TESTED_TORCH:
        return None
    return (
        f"torch {version} is not a version ort_autopatch is tested with ({tested}); its ONNX "
        f"exporter internals change between releases. Install torch {tested}"
    )
