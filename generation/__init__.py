"""The generation side that the web process needs: the model registry, typed
parameters, prompts, schemas and output parsing. Nothing here imports torch,
transformers' model code or xgrammar when it is imported; the worker runtime
that does is in ``workers/``."""
