"""The generation engine, shaped like vLLM's v1 engine: requests, the
scheduler, the model runner and its kernels, the core that steps them, and
the client that callers hold. It imports neither Django nor any app of the
service (``tests/test_layers.py``): the worker (``workers``) compiles
grammars, loads models and turns outputs into events; this package only
generates. ``interface`` is what a caller sees of any engine, this one or
one behind another server."""
