"""The OpenAI-compatible HTTP frontend: preprocessing, routing, streaming, metrics."""
