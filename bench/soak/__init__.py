"""A fault-injection soak of the whole product, with an invariant checker; run it with ``python -m bench.soak``
(options in ``bench/soak/__main__.py``)."""
