"""Draw a profile: prefill TTFT against ISL, decode ITL against KV usage per context (PNG, matplotlib)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from dynamo_cli.errors import ConfigError
from dynamo_cli.planner.profile import Profile


def plot_profile(profile: Profile, path: str | Path) -> None:
    """Write the two panels to `path`; ConfigError names the install command without matplotlib."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'dynamo-cli[plot]'") from None
    matplotlib.use("Agg")
    pyplot: Any = importlib.import_module("matplotlib.pyplot")
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4))
    points = sorted(profile.prefill, key=lambda s: s.isl)
    left.plot([s.isl for s in points], [s.ttft_ms for s in points], marker="o")
    left.set(xlabel="ISL (tokens)", ylabel="TTFT (ms)", title=f"prefill, {profile.engine} {profile.model}")
    for context in sorted({s.context_length for s in profile.decode}):
        row = sorted((s for s in profile.decode if s.context_length == context), key=lambda s: s.kv_usage)
        right.plot([s.kv_usage for s in row], [s.itl_ms for s in row], marker="o", label=f"context {context}")
    right.set(xlabel="KV usage", ylabel="ITL (ms)", title="decode")
    right.legend()
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
