"""`python -m ort_autopatch [options] script.py [args]`: see `ort_autopatch.cli`."""

if __name__ == "__main__":
    from ort_autopatch.cli import main

    raise SystemExit(main())
