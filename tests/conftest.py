"""Suite-wide settings.

Hypothesis profiles: ``ci`` (the default, used by ``make test`` and CI) is
derandomized and keeps no example database, so a property test gives the
same draws on every run and cannot turn red on a new random draw without a
change; ``explore`` draws at random (``HYPOTHESIS_PROFILE=explore``). Wide
random exploration runs in ``make chaos`` (tests/reliability/chaos.py sets
its own settings).
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
