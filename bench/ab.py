"""`python bench/ab.py ...` is `sapwood bench ab ...` (the code lives in sapwood.benchmarks.ab)."""
import sys

from sapwood.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ab", *sys.argv[1:]]))
