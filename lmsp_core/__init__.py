"""The protocol kernel: problem documents, JSON shapes of objects and events,
SSE framing, ids and strict request parsing. Any app may import it; it
imports no app (see README, "Architecture")."""
