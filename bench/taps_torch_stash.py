"""The ``taps`` CLI with the drafter's context stash on its torch path: the ``off`` side of the side-by-side run of
the one-call stash (``_C.stash_rows``, ``bench/results/stash_ab_*_off.json``).

    python bench/taps_torch_stash.py bench --dataset humaneval ...   (any ``taps`` command line)
"""
import sys

from taps.cli.main import main
from taps.models import drafter_state

drafter_state.DrafterInference._native_stash = staticmethod(lambda *args: None)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
