"""Routing: pick the worker for each request (round-robin, random, KV-aware)."""
