"""Benchmark cases, one file per module (``quant.py``, ``moe.py``, ``engram.py``, ``mhc.py``, ``transpose.py``); each
registers its ops with :func:`tritile.bench.register` when imported (:func:`tritile.bench.load_all` imports them).
``modeling.py`` is the MoE layer's benchmark (``python -m tritile.bench.cases.modeling``)."""
