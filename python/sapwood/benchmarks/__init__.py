"""Benchmarks behind `sapwood bench ...` (the A/B protocol, the width study, peers)."""
