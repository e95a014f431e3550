"""Dynamo's GPU-free simulated engine: vLLM-style scheduling, paged KV blocks, polynomial timing."""

from .engine import MockerEngine
from .ranks import RankedMocker, mocker_engine

__all__ = ["MockerEngine", "RankedMocker", "mocker_engine"]
