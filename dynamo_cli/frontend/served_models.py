"""What the frontend can serve: the router's model registry, each model with its tokenizer.

The registry itself (discovery watches, workers by role, routing policies) is `core/registry.py`;
the frontend adds what only it needs: the model's tokenizer, loaded off the event loop when the
model's first worker appears.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dynamo_cli.core import registry
from dynamo_cli.model.tokenizer import Tokenizer, load_tokenizer
from dynamo_cli.model_card import ModelCard
from dynamo_cli.runtime.supervisor import freeze_heap


@dataclass(slots=True, kw_only=True)
class ServedModel(registry.ModelEntry):
    """A served model, with its tokenizer."""

    tokenizer: asyncio.Future[Tokenizer]
    """Loading in an executor thread; await it."""


class FrontendRegistry(registry.Registry[ServedModel]):
    """The frontend's live view of models and workers."""

    def _new_entry(self, card: ModelCard) -> ServedModel:
        tokenizer = asyncio.get_running_loop().run_in_executor(None, load_tokenizer, card.tokenizer_source)
        tokenizer.add_done_callback(lambda _: freeze_heap())  # a vocabulary: long-lived, and many objects
        return ServedModel(
            name=card.display_name,
            card=card,
            tokenizer=tokenizer,
            policy=self._policy_factory(card),
            prefill_policy=self._prefill_policy_factory(card),
        )
