"""OpenAI-compatible endpoints under ``/v1/``: an adapter that maps OpenAI's
request and answer shapes onto LMSP's, on top of the same validation,
workers, event log, tokens and ownership."""
