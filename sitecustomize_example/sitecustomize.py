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
        from ort_autopatch.activation import activate
        from ort_autopatch.config import load_config

        activate(load_config())
    except Exception as exc:  # a bad setting must not break every Python on the machine
        sys.stderr.write(f"[ort_autopatch] ERROR not activated: {type(exc).__name__}: {exc}\n")
