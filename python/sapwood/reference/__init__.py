"""numpy oracles: the executable spec of every sapwood kernel and of the model.

Written for clarity, in float64 where that helps; the fast kernels are compared against these.
"""
