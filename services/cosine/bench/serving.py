"""`cosine bench serving`: an alias of `cosine bench compare` (CoSine against its baselines, side by side).

The earlier serving benchmark (target-only against the cluster with a few drafter sets) is
now part of `compare`: `target-only`, `cosine-plain` and the speculating systems are rows of
its table. See `cosine bench compare --help`.
"""

from __future__ import annotations

import sys

from cosine.bench.compare import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
