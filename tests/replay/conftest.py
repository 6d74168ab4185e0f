"""Hypothesis profiles for the replay fuzzer.

``default`` keeps ``make test`` short and deterministic; ``make fuzz`` selects ``fuzz`` (>= 10 000 streams) with
``HYPOTHESIS_PROFILE=fuzz``. Streams are slow-ish (a real vLLM scheduler each), so there is no
per-example deadline.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large])
# derandomized, no example database: `make test` (and CI) replays the same 30 streams every time
settings.register_profile("default", max_examples=30, derandomize=True, database=None, **_COMMON)
settings.register_profile("fuzz", max_examples=10_000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
