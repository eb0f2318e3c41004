// Tree bookkeeping: parents[N] -> depths, ancestor tables, commit path checks.
// parents[0] == -1 (the root); 0 <= parents[i] < i for i > 0.
#pragma once
#include <vector>

#include "common.h"

namespace sapwood {

inline void check_parents(const int* parents, int n) {
  SW_CHECK(n > 0, "a tree needs at least one node");
  SW_CHECK(parents[0] == -1, "parents[0] must be -1 (the root), got ", parents[0]);
  for (int i = 1; i < n; ++i)
    SW_CHECK(parents[i] >= 0 && parents[i] < i, "parents[", i, "] = ", parents[i],
             " must satisfy 0 <= parents[i] < ", i, " (one root, parents before children)");
}

inline std::vector<int> tree_depths(const int* parents, int n) {
  std::vector<int> d(n, 0);
  for (int i = 1; i < n; ++i) d[i] = d[parents[i]] + 1;
  return d;
}

// anc[i * stride + d] = the node at depth d on the root-to-i path; stride = max depth + 1.
inline std::vector<int> ancestor_table(const int* parents, int n, int* stride) {
  std::vector<int> depth = tree_depths(parents, n);
  int s = 0;
  for (int x : depth) s = std::max(s, x + 1);
  std::vector<int> anc(size_t(n) * s, -1);
  for (int i = 0; i < n; ++i)
    for (int node = i; node >= 0; node = parents[node]) anc[size_t(i) * s + depth[node]] = node;
  *stride = s;
  return anc;
}

// A commit path is [0, ..., leaf] with each node the child of the one before.
inline void check_path(const int* parents, int n, const std::vector<int>& path) {
  SW_CHECK(!path.empty() && path[0] == 0, "commit path must start at the root node 0");
  for (size_t j = 1; j < path.size(); ++j) {
    const int b = path[j];
    SW_CHECK(b >= 0 && b < n, "commit path node ", b, " is not in the tree of ", n, " nodes");
    SW_CHECK(parents[b] == path[j - 1], "commit path: node ", b, " is not a child of node ",
             path[j - 1]);
  }
}

}  // namespace sapwood
