"""The rule that nothing accepted is ignored: a request field that needs an engine `Feature` is refused,
with a 400 naming the field and the engine, when the serving model's card does not list it.

NOTE: the check runs before routing, against the model's card (every worker of a model serves the same
engine). A field at its no-op value (presence_penalty 0, logit_bias {}, logprobs false) asks nothing
and passes whatever the engine. Fields that ask nothing of the engine (`user`, `metadata`) are not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynamo_cli.engine import Feature
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.served_models import ServedModel
from dynamo_cli.model_card import ModelCard


def _not_zero(value: Any) -> bool:
    return value is not None and value != 0


def _not_one(value: Any) -> bool:
    return value is not None and value != 1


def _truthy(value: Any) -> bool:
    return bool(value)


def _set(value: Any) -> bool:
    return value is not None and value is not False


FIELD_FEATURES: tuple[tuple[str, Feature, Callable[[Any], bool]], ...] = (
    ("presence_penalty", Feature.PENALTIES, _not_zero),
    ("frequency_penalty", Feature.PENALTIES, _not_zero),
    ("repetition_penalty", Feature.PENALTIES, _not_one),
    ("logit_bias", Feature.LOGIT_BIAS, _truthy),
    ("min_p", Feature.MIN_P, _not_zero),
    ("logprobs", Feature.LOGPROBS, _set),  # chat: true; completions: 0..5 (0 still asks for the chosen token's)
    ("top_logprobs", Feature.LOGPROBS, _not_zero),
    ("nvext.agent_hints.resume_after_s", Feature.KV_RETAIN, _set),
)
"""Request field -> the Feature it needs -> whether a value asks for it (else it is the no-op)."""


def asked(request: Any) -> list[tuple[str, Feature]]:
    """The (field, feature) pairs `request` asks for."""
    return [(name, feature) for name, feature, is_asking in FIELD_FEATURES if is_asking(_field(request, name))]


def _field(request: Any, name: str) -> Any:
    """The value at a dotted path (`nvext.agent_hints.resume_after_s`), None where a part is missing."""
    value = request
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def check_features(request: Any, card: ModelCard) -> None:
    """RequestError (400, param = the field) for the first field the card's engine does not honour."""
    honoured = set(card.features)
    for name, feature in asked(request):
        if feature.value not in honoured:
            have = ", ".join(sorted(honoured)) or "none"
            raise RequestError(
                f"'{name}' is not supported by the {card.engine} engine serving model '{card.display_name}' "
                f"(it honours: {have}); remove the field or serve the model with an engine that has {feature.value}",
                param=name,
                code="unsupported_parameter",
            )


def require_feature(entry: ServedModel, feature: Feature, what: str, fix: str) -> None:
    """A 400 naming the model unless its engine's card lists `feature` (`what` it does not do, and the `fix`)."""
    card = entry.card
    if feature.value not in card.features:
        raise RequestError(
            f"model '{entry.name}' ({card.engine} engine) {what}; {fix}", param="model", code="unsupported_parameter"
        )
