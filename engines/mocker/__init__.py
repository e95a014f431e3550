"""Dynamo's GPU-free simulated engine: vLLM-style scheduling, paged KV blocks, polynomial timing."""

from .engine import MockerEngine

__all__ = ["MockerEngine"]
