"""The folder the launcher puts first on PYTHONPATH; only its `sitecustomize.py` matters."""
