"""Load time and peak memory per checkpoint and weights mode (sapwood.benchmarks.load)."""
import sys

from sapwood.benchmarks.load import main

sys.exit(main())
