"""The routers' view of one worker's adapters: which it serves (its card) and which it has loaded.

The loaded set comes from the worker's load reports (`LoadMetrics.loras`, least recently used first) and,
between two reports, from this router's own decisions: a request sent with an adapter leaves it loaded there
(the worker loads it if it was not, evicting its least recently used one past `max_loras`), so the next
decision already sees it. A report replaces the guess.

What a worker that must load the adapter first costs is `load_s`: the seconds its last load took (reported),
else DEFAULT_LOAD_S; the KV router adds it to that candidate's cost like an onboard (routing/cost.py), so
requests go where their adapter is loaded until the queue there costs more than a load elsewhere: a hot
adapter spreads by itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from dynamo_cli.wire import LoadMetrics

DEFAULT_LOAD_S = 0.1
"""A load's cost before the worker reported one (seconds)."""


@dataclass(slots=True)
class AdapterView:
    """One worker's adapters as a router sees them."""

    served: frozenset[str] = frozenset()
    """What its card lists."""
    max_loras: int = 0
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Loaded there (reported, then guessed from routing), least recently used first."""
    load_s: float = DEFAULT_LOAD_S
    loads: int = 0
    """Loads it reported (cumulative)."""

    @classmethod
    def of(cls, loras: Sequence[str], max_loras: int) -> AdapterView:
        return cls(frozenset(loras), max_loras)

    def serves(self, lora: str) -> bool:
        return lora in self.served

    def is_resident(self, lora: str) -> bool:
        return lora in self.resident

    def cost_s(self, lora: str) -> float:
        """Seconds a request of `lora` waits for its load here (0: loaded)."""
        return 0.0 if lora in self.resident else self.load_s

    def reported(self, load: LoadMetrics) -> None:
        """The worker's own account replaces the guess."""
        self.resident = OrderedDict.fromkeys(load.loras)
        self.loads = load.lora_loads
        if load.lora_load_s > 0:
            self.load_s = load.lora_load_s

    def routed(self, lora: str) -> None:
        """A request with `lora` was sent here: it is loaded now (the least recently used one out past max)."""
        self.resident[lora] = None
        self.resident.move_to_end(lora)
        while self.max_loras and len(self.resident) > self.max_loras:
            self.resident.popitem(last=False)

    def updated(self, loras: Sequence[str], max_loras: int) -> AdapterView:
        """This view after the worker published a new card (an adapter loaded or unloaded at run time)."""
        served = frozenset(loras)
        resident = OrderedDict((name, None) for name in self.resident if name in served)
        return AdapterView(served, max_loras, resident, self.load_s, self.loads)
