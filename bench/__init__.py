"""ckptd's side-by-side benchmark: ``python -m bench`` (``--smoke`` for a quick run)."""
