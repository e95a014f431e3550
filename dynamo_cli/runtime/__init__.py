"""Distributed runtime: names, planes (discovery, events, request), supervisor. Knows nothing about LLMs."""
