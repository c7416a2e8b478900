"""Benchmark clients behind ``jaxserve bench``: ``serve`` (an online benchmark against a running server).

They are not part of the server: the server never imports them, and their extra dependencies (httpx, and
matplotlib for ``--plot``) are imported only when a benchmark runs (the ``bench`` extra: ``pip install -e
".[bench]"`` in the repository).
"""
