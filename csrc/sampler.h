// The keyed sampler of docs/design.md ("Sampling keyed by (seed, position, id)"), as
// python/sapwood/reference/sampling.py defines it bit for bit, without sorting the vocabulary:
// top-k and top-p by selection, the Gumbel noise computed only for ids that could still win.
#pragma once
#include <cstdint>
#include <vector>

namespace sapwood {

// SplitMix64's finaliser (sampling.mix64): the sampler's noise and the drafts' picks.
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct SampleParams {
  double temperature = 0.0;  // 0: argmax (ties: lower id)
  int64_t top_k = 0;         // 0 (or >= V): off
  double top_p = 1.0;        // 1: off
  double min_p = 0.0;        // 0: off
  uint64_t seed = 0;
  // Penalties (sampling.apply_penalties), counted over `history` (and, in a walk, the path
  // down to each node): the token ids before the position sampled.
  double repetition_penalty = 1.0;  // 1: off
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::vector<int> history;
  bool penalised() const {
    return repetition_penalty != 1.0 || presence_penalty != 0.0 || frequency_penalty != 0.0;
  }
};

// sampling.SamplingParams.validate's ranges, for callers that come straight here: InputError
// naming the value.
void check_sample_params(const SampleParams& p);

// An allowed-token bitmask per row, in the layout llguidance and xgrammar fill: bit (i % 32)
// of word i / 32 allows id i, mask_words(V) words a row. Applied before everything else
// (penalties, temperature, top-k/p, min-p), as if the disallowed logits were -inf: a
// disallowed id is never drawn, greedy takes the allowed argmax. Null: no mask.
inline int mask_words(int V) { return (V + 31) / 32; }

// Tokens for rows of logits x [n][V] at positions [n], on up to `threads` threads of the pool
// (0: its default; the draws do not depend on it). Checks every row first, as
// sampling.check_logits does (NaN, +inf, a row all -inf), throwing InputError with the first
// offending flat index.
template <class T>
void sample_rows(const T* x, int n, int V, const uint64_t* positions, const SampleParams& p,
                 int64_t* out, int threads = 0, const uint32_t* mask = nullptr);

// The walk of a verified tree (docs/design.md "Exactness"): from the root, the pick at each node
// (sample_rows at that node's position, base_position + depth + 1, penalties counting the
// history and the path's tokens through that node), then the child carrying it (the lowest
// such node), until a node has none. logits [n][V] of tokens/parents; `masks` (null: none)
// one row per node, the node's own pick's (a constrained request: its grammar state).
struct Walk {
  std::vector<int> path;   // node indices from the root
  std::vector<int> picks;  // the pick at each node of the path: the tokens it emits
};
Walk walk_tree(const float* logits, int V, const std::vector<int>& tokens,
               const std::vector<int>& parents, uint64_t base_position, const SampleParams& p,
               int threads = 0, const uint32_t* masks = nullptr);

}  // namespace sapwood
