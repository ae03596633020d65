"""Activate ort_autopatch in every Python process, without the launcher.

Python imports a module named ``sitecustomize`` at startup if one is on sys.path. With this
folder on PYTHONPATH (or this file copied into site-packages), every interpreter reads the same
ORT_AUTOPATCH_* variables the launcher reads. It does nothing unless ORT_AUTOPATCH_MODULES is
set, and never stops Python from starting. See README.md here.
"""

import os
import sys

if os.environ.get("ORT_AUTOPATCH_MODULES", "").strip():
    try:
        from ort_autopatch.activation import activate_from_environment

        activate_from_environment(strict=False)  # a bad setting: one error line
    except Exception as exc:  # ort_autopatch itself broken: never break every Python
        sys.stderr.write(f"[ort_autopatch] ERROR not activated: {type(exc).__name__}: {exc}\n")
