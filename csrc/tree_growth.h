// Best-first tree growth over a draft lattice, priced by a calibrated acceptance table: the
// per-round part of the auto policy that ran in Python (sapwood.tree.grow with
// AcceptanceModel.chance, and AcceptanceModel.expected_tokens), which cost a round far more
// there than here.
// python/sapwood/tree.py's grow is the oracle: the same pops
// in the same order, the same doubles (tests/test_policy.py compares them with ==).
#pragma once
#include <cmath>
#include <queue>
#include <vector>

#include "common.h"

namespace sapwood {

// A calibrated acceptance table: chance[(g * ranks + r) * buckets + b] for candidates at
// group g of rank r (capped at ranks - 1) whose draft log-probability falls in bucket b (how
// many log_edges are <= it). Groups 0 .. depths - 1 are depth - 1 (capped) on the drafter's own
// line; group `depths` holds every node off it (an ancestor below the root is not its row's
// first candidate), whose row was drafted for another prefix. log_step is
// log(max(chance, 1e-12)), computed once by numpy so both growers add the same doubles.
struct AcceptanceTable {
  const double* chance;
  const double* log_step;
  int depths, ranks, buckets;  // depths + 1 groups
  const double* log_edges;     // [buckets - 1], ascending

  int cell(int64_t depth, int64_t rank, double logprob, bool off) const {
    SW_CHECK(!std::isnan(logprob), "a draft log-probability is NaN (rank ", rank, ")");
    int b = 0;
    while (b < buckets - 1 && log_edges[b] <= logprob) ++b;
    const int64_t g = off ? depths : depth < depths ? depth - 1 : depths - 1;
    return int((g * ranks + (rank < ranks - 1 ? rank : ranks - 1)) * buckets + b);
  }
};

struct GrownTree {
  std::vector<int64_t> tokens, parents, depth, rank;
  std::vector<double> logp, q;
};

// E(w) for every prefix w = 1..n: the sum of the nodes' reach, a node's reach its parent's
// times its own chance (the root's is 1).
inline std::vector<double> expected_tokens(const int64_t* parents, const int64_t* depth,
                                           const int64_t* rank, const double* q, int n,
                                           const AcceptanceTable& t) {
  std::vector<double> reach(n, 1.0), e(n, 1.0);
  std::vector<char> off(n, 0);
  for (int i = 1; i < n; ++i) {
    const int64_t p = parents[i];
    off[i] = p > 0 && (off[p] || rank[p] > 0);
    reach[i] = reach[p] * t.chance[t.cell(depth[i], rank[i], q[i], off[i])];
    e[i] = e[i - 1] + reach[i];
  }
  return e;
}

// The first `width` nodes of the best-first tree (fewer where the lattice runs out). Row r has
// counts[r] candidates at tokens/logprobs[r * k ..], at depth r + 1. A candidate's step is its
// table log-chance made non-increasing in rank (siblings pop in rank order); nodes pop by descending path sum,
// ties to the earlier push. Popping pushes the node's first child and its next sibling.
inline GrownTree grow_best_first(int64_t root, const int64_t* tokens, const double* logprobs,
                                 const int* counts, int rows, int k, int width,
                                 const AcceptanceTable& t) {
  SW_CHECK(width >= 1, "width must be >= 1, got ", width);
  // step[line][r * k + j]: on the drafter's line (0) and off it (1)
  std::vector<double> step[2] = {std::vector<double>(size_t(rows) * k),
                                 std::vector<double>(size_t(rows) * k)};
  for (int line = 0; line < 2; ++line)
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < counts[r]; ++j) {
        std::vector<double>& st = step[line];
        const double s = t.log_step[t.cell(r + 1, j, logprobs[r * k + j], line)];
        st[r * k + j] = j == 0 || s < st[r * k + j - 1] ? s : st[r * k + j - 1];
      }
  struct Push { double lp; int64_t order; int parent, row, rank; };
  auto later = [](const Push& a, const Push& b) {  // priority_queue pops the "largest"
    return a.lp < b.lp || (a.lp == b.lp && a.order > b.order);
  };
  std::priority_queue<Push, std::vector<Push>, decltype(later)> heap(later);
  GrownTree g;
  g.tokens = {root}; g.parents = {-1}; g.depth = {0}; g.rank = {-1}; g.logp = {0.0}; g.q = {0.0};
  // per node: are its children off the drafter's line (it is, or it is not its row's first)?
  std::vector<char> kids_off = {0};
  int64_t order = 0;
  auto push = [&](int parent, int row, int rank) {
    if (row < rows && rank < counts[row])
      heap.push({g.logp[parent] + step[kids_off[parent]][row * k + rank], order++, parent, row,
                 rank});
  };
  push(0, 0, 0);
  while (!heap.empty() && int(g.tokens.size()) < width) {
    const Push p = heap.top();
    heap.pop();
    const int node = int(g.tokens.size());
    g.tokens.push_back(tokens[p.row * k + p.rank]);
    g.parents.push_back(p.parent);
    g.depth.push_back(p.row + 1);
    g.rank.push_back(p.rank);
    g.logp.push_back(p.lp);
    g.q.push_back(logprobs[p.row * k + p.rank]);
    kids_off.push_back(kids_off[p.parent] || p.rank > 0);
    push(node, p.row + 1, 0);
    push(p.parent, p.row, p.rank + 1);
  }
  return g;
}

}  // namespace sapwood
