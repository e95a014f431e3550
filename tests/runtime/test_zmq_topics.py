"""The embedded event plane's ZMQ topics: the kind first, so a SUB socket's prefix filter (applied at the
publisher) passes exactly what a pattern naming its last token can match."""

from __future__ import annotations

import pytest

from dynamo_cli.runtime.embedded import _topic, _topic_prefix
from dynamo_cli.runtime.events import subject_matches

SUBJECTS = [
    "namespace.dyn.component.backend.kv-events",
    "namespace.dyn.component.backend.kv-metrics",
    "namespace.dyn.component.prefill.kv-events",
    "namespace.other.component.backend.kv-events",
    "namespace.dyn.frontends.abc",
]
PATTERNS = [
    "namespace.dyn.component.*.kv-events",
    "namespace.dyn.component.*.kv-metrics",
    "namespace.dyn.component.backend.kv-events",
    "namespace.dyn.>",
    "namespace.*.component.*.*",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_subject_a_pattern_matches_passes_its_prefix_filter(pattern: str) -> None:
    for subject in SUBJECTS:
        if subject_matches(pattern, subject):
            assert _topic(subject).startswith(_topic_prefix(pattern)), subject


def test_a_load_subscription_is_not_sent_kv_events() -> None:
    load = _topic_prefix("namespace.dyn.component.*.kv-metrics")
    assert not _topic("namespace.dyn.component.backend.kv-events").startswith(load)
    assert _topic("namespace.dyn.component.backend.kv-metrics").startswith(load)


def test_a_topic_gives_its_subject_back() -> None:
    for subject in SUBJECTS:
        assert _topic(subject).decode().partition(" ")[2] == subject
