"""The draft's ranking: log-probabilities of a row of logits (Engine.draft_candidates)."""
from __future__ import annotations

import numpy as np


def logsumexp(x) -> float:
    """max(x) + log(sum(exp(x - max))) in float64."""
    x = np.asarray(x, np.float64)
    m = x.max()
    return float(m + np.log(np.exp(x - m).sum()))
