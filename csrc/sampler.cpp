// The keyed sampler (sampler.h). Every number that decides a draw is computed with the same
// operations, in the same order and with the same libm calls as the reference
// (python/sapwood/reference/sampling.py, which calls math.exp / math.log per id for that
// reason); what differs is only which ids are looked at:
// - top-p: the kept set is a prefix of the (scaled logit desc, id asc) order whose integer
//   weights sum below a threshold; integer sums do not depend on the order they are added
//   in, so a histogram over s finds the bin of the cut and only that bin is sorted;
// - top-k: a heap of the k best, most ids going by one comparison;
// - Gumbel-max: an id whose logit is d below the best score so far needs noise above d to
//   win; the noise g = -log(-log u) is at most -log(1 - u), so a test of its hash against a
//   table (u < 1 - e^-d) rules most ids out without a logarithm.
#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "kernels/kernels.h"
#include "thread_pool.h"

namespace sapwood {

namespace {

// Top-p weights: w = floor(e^s * 2^40) with s <= 0 the scaled logit, exact integers, so the
// kept prefix does not depend on summation order. e^s < 2^-40 (s < -40 ln 2 = -27.73) is 0.
constexpr double kWeightScale = 0x1p40;
constexpr double kZeroWeightBelow = -27.8;
// top_p quantised up to a multiple of 2^-32: P = ceil(p * 2^32) >= 1, so the first id is kept.
constexpr double kTopPScale = 0x1p32;

struct Item {
  double s;    // scaled logit (x - max) / T, <= 0
  uint64_t w;  // top-p weight
  int id;
};
// The sampler's order: scaled logit descending, ties to the lower id.
inline bool before(const Item& a, const Item& b) {
  return a.s > b.s || (a.s == b.s && a.id < b.id);
}

// skip_below[b]: an id whose logit is at least b/8 (+1e-6) below the best score cannot win
// while its hash's top 53 bits are below this (u < 1 - e^(-b/8), two units of margin).
constexpr int kBuckets = 320;  // b/8 up to 40: past it u < 1 - e^-40 rules out all but ~1e-17
struct NoiseBound {
  int64_t skip_below[kBuckets];
  NoiseBound() {
    for (int b = 0; b < kBuckets; ++b)
      skip_below[b] = int64_t(std::floor((1.0 - std::exp(-b / 8.0)) * 0x1p53)) - 2;
  }
};
const NoiseBound& noise_bound() {
  static const NoiseBound b;
  return b;
}

struct Best {
  double score = -INFINITY;
  int id = -1;
};

// Whether an id (scaled logit s, hash h) is sure to score below `score`: it would need noise
// above d = score - s, and g = -log(-log u) <= -log(1 - u) is below d while u < 1 - e^-d
// (the 1e-6 covers the rounding of both scores; d is large whenever |s| is).
inline bool ruled_out(double score, double s, uint64_t h, const NoiseBound& nb) {
  const double d = score - s - 1e-6;
  const double capped = d < (kBuckets - 1) / 8.0 ? d : (kBuckets - 1) / 8.0;  // no branch: minsd
  return d > 0.125 && int64_t(h >> 11) < nb.skip_below[int(capped * 8.0)];
}

// Offer id (scaled logit s) to the Gumbel argmax keyed by `key`, if `kept` (asked only of
// the ids the noise bound leaves).
template <class Kept>
inline void offer(Best& best, double s, int id, uint64_t key, const NoiseBound& nb, Kept kept) {
  const uint64_t h = mix64(key ^ uint64_t(uint32_t(id)));
  if (ruled_out(best.score, s, h, nb) || !kept()) return;
  const double u = (double(h >> 11) + 0.5) * 0x1p-53;
  const double score = s - std::log(-std::log(u));
  if (score > best.score || (score == best.score && id < best.id)) best = {score, id};
}
inline void offer(Best& best, double s, int id, uint64_t key, const NoiseBound& nb) {
  offer(best, s, id, key, nb, [] { return true; });
}

// A row's candidates: the finite ids, or (after top-k) the listed ones, with their scaled
// logits s = (x - max) / T, as the reference computes them. The passes over them run in
// chunks on the pool; each chunk's result is exact (integer sums, its own argmax), so the
// thread count never changes a draw.
template <class T>
struct Row {
  const T* x;
  int V;
  double m, temperature;
  int threads;
  const std::vector<int>* ids = nullptr;  // top-k's set; null: every finite id
  static constexpr int kChunk = 1 << 15;

  double s(int i) const { return (double(x[i]) - m) / temperature; }
  int count() const { return ids ? int(ids->size()) : V; }
  int chunks() const { return (count() + kChunk - 1) / kChunk; }
  // f(s, id) for the candidates of chunk c
  template <class F>
  void each_in(int c, F f) const {
    const int begin = c * kChunk, end = std::min(count(), begin + kChunk);
    if (ids) {
      for (int j = begin; j < end; ++j) f(s((*ids)[size_t(j)]), (*ids)[size_t(j)]);
      return;
    }
    for (int i = begin; i < end; ++i)
      if (double(x[i]) != -INFINITY) f(s(i), i);
  }
  template <class F>
  void each(F f) const {
    for (int c = 0; c < chunks(); ++c) each_in(c, f);
  }
  // g(c) for every chunk, on the pool
  template <class G>
  void parallel(G g) const {
    parallel_for(chunks(), threads_for(count(), threads), [&](int c) { g(c); });
  }
};

// Top-k: the k first candidates in the order, by a heap of the best so far (most ids go by
// one comparison with its worst).
template <class T>
std::vector<int> top_k_ids(const Row<T>& row, int64_t k) {
  std::vector<Item> heap;  // a max-heap by `before`'s reverse: heap.front() is the worst held
  heap.reserve(size_t(k));
  row.each([&](double s, int i) {
    const Item it{s, 0, i};
    if (int64_t(heap.size()) < k) {
      heap.push_back(it);
      std::push_heap(heap.begin(), heap.end(), before);
    } else if (before(it, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), before);
      heap.back() = it;
      std::push_heap(heap.begin(), heap.end(), before);
    }
  });
  std::vector<int> ids(heap.size());
  for (size_t j = 0; j < heap.size(); ++j) ids[j] = heap[j].id;
  return ids;
}

inline uint64_t top_p_weight(double s) {
  return s < kZeroWeightBelow ? 0 : uint64_t(std::exp(s) * kWeightScale);  // >= 0: floor
}

// Top-p's kept set is the candidates before a boundary in the order: rank r is kept while the
// weights before it sum below Q = ceil(P * total / 2^32). Candidates are binned by s (bins
// follow the order), the bin where the sum reaches Q is sorted, and the boundary found in it.
struct TopPCut {
  static constexpr int kBins = 4096;  // over s in [-27.8, 0]: zero weights fall past them
  static int bin(double s) {
    return s < kZeroWeightBelow ? kBins : std::min(kBins - 1, int(s * (kBins / kZeroWeightBelow)));
  }
  int last_bin = kBins;  // every candidate of a bin below it is kept
  bool inside = false;   // the boundary lies inside last_bin: kept there iff before(first_dropped)
  Item first_dropped{};
  bool keeps(double s, int i) const {
    const int b = bin(s);
    return b < last_bin || (b == last_bin && (!inside || before({s, 0, i}, first_dropped)));
  }
};

template <class T>
TopPCut top_p_cut(const Row<T>& row, double top_p) {
  using u128 = unsigned __int128;
  constexpr int kSlots = TopPCut::kBins + 1;
  // per chunk and bin: at most 2^15 weights of at most 2^40 each, so uint64 holds them
  std::vector<uint64_t> mass(size_t(row.chunks()) * kSlots, 0);
  // per candidate id (this thread's; the workers fill it); other ids' entries are stale
  thread_local std::vector<uint16_t> bins;
  bins.resize(size_t(row.V));
  uint16_t* bin_of = bins.data();
  row.parallel([&](int c) {
    uint64_t* m = mass.data() + size_t(c) * kSlots;
    row.each_in(c, [&](double s, int i) {
      const int b = TopPCut::bin(s);
      bin_of[i] = uint16_t(b);
      m[b] += top_p_weight(s);
    });
  });
  std::vector<u128> per_bin(kSlots, 0);
  u128 total = 0;
  for (int c = 0; c < row.chunks(); ++c)
    for (int b = 0; b < kSlots; ++b) per_bin[size_t(b)] += mass[size_t(c) * kSlots + b];
  for (u128 m : per_bin) total += m;
  const u128 P = u128(std::ceil(top_p * kTopPScale));
  const u128 Q = (P * total + (u128(1) << 32) - 1) >> 32;  // 1 <= Q <= total
  TopPCut cut;
  u128 acc = 0;  // the weight of the bins before b
  int b = 0;
  while (acc + per_bin[size_t(b)] < Q) acc += per_bin[size_t(b++)];
  // bin b (one of the kBins: the zero-weight ones cannot reach Q) holds the rank where the
  // sum reaches Q: its candidates in order
  thread_local std::vector<Item> items;
  items.clear();
  auto collect = [&](int i) {
    if (bin_of[i] == b && double(row.x[i]) != -INFINITY) {
      const double s = row.s(i);
      items.push_back({s, top_p_weight(s), i});
    }
  };
  if (row.ids)
    for (int i : *row.ids) collect(i);
  else
    for (int i = 0; i < row.V; ++i) collect(i);
  std::sort(items.begin(), items.end(), before);
  cut.last_bin = b;
  for (const Item& it : items) {
    if (!(acc < Q)) {
      cut.inside = true;
      cut.first_dropped = it;
      break;
    }
    acc += it.w;
  }
  return cut;
}

// NaN or +inf anywhere, by the bits (integer compares vectorise; float ones with NaNs in play
// did not): NaN has an all-ones exponent and a mantissa, +inf is exactly the exponent's bits.
template <class T>
bool any_nan_or_posinf(const T* x, size_t n) {
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  const I inf = sizeof(T) == 4 ? I(0x7f800000) : I(0x7ff0000000000000ll);
  const I abs = sizeof(T) == 4 ? I(0x7fffffff) : I(0x7fffffffffffffffll);
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    I b;
    __builtin_memcpy(&b, x + i, sizeof(T));
    bad |= ((b & abs) > inf) | (b == inf);
  }
  return bad;
}

template <class T>
int first_max_of(const T* row, int V) {
  if constexpr (std::is_same_v<T, float>) {
    return kernels().argmax(row, size_t(V));
  } else {
    int first_max = 0;
    for (int i = 1; i < V; ++i)
      if (row[i] > row[first_max]) first_max = i;
    return first_max;
  }
}

template <class T>
int sample_one(const T* x, int V, int first_max, uint64_t position, const SampleParams& p,
               int threads) {
  if (p.temperature == 0.0) return first_max;
  const uint64_t key = mix64(mix64(p.seed) ^ position);
  Row<T> row{x, V, double(x[first_max]), p.temperature, threads};
  std::vector<int> ids;
  if (p.top_k > 0 && p.top_k < V) {
    ids = top_k_ids(row, p.top_k);
    row.ids = &ids;
  }
  TopPCut cut;  // keeps every candidate while top-p is off
  if (p.top_p < 1.0) cut = top_p_cut(row, p.top_p);
  // min-p: e^s >= min_p, with e^s computed only near the boundary (exp and log are within an
  // ulp, so 1e-9 away from log(min_p) the comparison cannot go the other way)
  const double min_p_cut = p.min_p > 0.0 ? std::log(p.min_p) : -INFINITY;
  auto keeps_min_p = [&](double s) {
    if (s > min_p_cut + 1e-9) return true;
    if (s < min_p_cut - 1e-9) return false;
    return std::exp(s) >= p.min_p;
  };
  const NoiseBound& nb = noise_bound();
  std::vector<Best> bests(size_t(row.chunks()));
  row.parallel([&](int c) {
    Best& best = bests[size_t(c)];
    offer(best, 0.0, first_max, key, nb);  // the first maximum survives every filter
    row.each_in(c, [&](double s, int i) {
      offer(best, s, i, key, nb, [&] { return cut.keeps(s, i) && keeps_min_p(s); });
    });
  });
  Best best = bests[0];
  for (const Best& b : bests)
    if (b.score > best.score || (b.score == best.score && b.id < best.id)) best = b;
  return best.id;
}

}  // namespace

void check_sample_params(const SampleParams& p) {
  SW_CHECK(std::isfinite(p.temperature) && p.temperature >= 0.0, "temperature=", p.temperature,
           ": must be finite and >= 0 (0 is greedy)");
  SW_CHECK(p.top_k >= 0, "top_k=", p.top_k, ": must be >= 0 (0 disables)");
  SW_CHECK(p.top_p > 0.0 && p.top_p <= 1.0, "top_p=", p.top_p, ": must be in (0, 1]");
  SW_CHECK(p.min_p >= 0.0 && p.min_p <= 1.0, "min_p=", p.min_p, ": must be in [0, 1]");
  SW_CHECK(p.repetition_penalty >= 0.01 && p.repetition_penalty <= 100.0, "repetition_penalty=",
           p.repetition_penalty, ": must be in [0.01, 100] (1 is off)");
  SW_CHECK(p.presence_penalty >= -2.0 && p.presence_penalty <= 2.0, "presence_penalty=",
           p.presence_penalty, ": must be in [-2, 2] (0 is off)");
  SW_CHECK(p.frequency_penalty >= -2.0 && p.frequency_penalty <= 2.0, "frequency_penalty=",
           p.frequency_penalty, ": must be in [-2, 2] (0 is off)");
}

namespace {

using Counts = std::unordered_map<int, int64_t>;

Counts count_history(const std::vector<int>& history, int V) {
  Counts c;
  for (size_t i = 0; i < history.size(); ++i) {
    SW_CHECK(history[i] >= 0 && history[i] < V, "history[", i, "] = ", history[i],
             ": token ids must be in [0, ", V, ")");
    ++c[history[i]];
  }
  return c;
}

// sampling.apply_penalties on a copy of the row, in the row's precision as numpy computes it:
// repetition divides a positive logit by r (multiplies a negative one), then presence and
// frequency subtract T(presence + frequency * count), for the ids in the history.
template <class T>
const T* penalised(const T* row, int V, const Counts& counts, const SampleParams& p) {
  thread_local std::vector<T> out;
  out.assign(row, row + V);
  const T r = T(p.repetition_penalty);
  for (const auto& [id, count] : counts) {
    T& x = out[size_t(id)];
    if (p.repetition_penalty != 1.0) x = x > 0 ? x / r : x * r;
    x -= T(p.presence_penalty * 1.0 + p.frequency_penalty * double(count));
  }
  return out.data();
}

// Row r under its mask: a copy with the disallowed ids at -inf (-inf stays -inf through the
// penalties, so masking first is masking last), or InputError when nothing allowed is left.
template <class T>
const T* masked(const T* row, int V, const uint32_t* bits, int r) {
  thread_local std::vector<T> out;
  out.resize(size_t(V));
  bool any = false, finite = false;
  for (int w = 0; w < mask_words(V); ++w) {
    const uint32_t b = bits[w];
    const int lo = w * 32, hi = std::min(V, lo + 32);
    any |= b != 0 && (hi - lo == 32 || (b & ((1u << (hi - lo)) - 1)) != 0);
    if (b == 0) {  // whole words of one kind are the common case (a JSON state: few ids set)
      std::fill(out.begin() + lo, out.begin() + hi, -T(INFINITY));
      continue;
    }
    for (int i = lo; i < hi; ++i) {
      const bool ok = (b >> (i - lo)) & 1u;
      out[size_t(i)] = ok ? row[i] : -T(INFINITY);
      finite |= ok && row[i] != -T(INFINITY);
    }
  }
  if (!any) throw InputError(cat("token mask row ", r, " allows no token: nothing can be sampled"));
  if (!finite)
    throw InputError(cat("token mask row ", r, " allows only tokens whose logits are -inf: "
                         "nothing can be sampled"));
  return out.data();
}

// sample_rows over checked parameters, the penalties (if any) counted from `counts`; `mask`
// (null: none) mask_words(V) words a row.
template <class T>
void sample_counted(const T* x, int n, int V, const uint64_t* positions, const SampleParams& p,
                    const Counts* counts, int64_t* out, int threads,
                    const uint32_t* mask = nullptr) {
  // As sampling.check_logits, every row before any draw: NaN first, then +inf, then a row
  // with nothing to sample (penalties within their ranges keep finite logits finite). The
  // first pass has no early exit, so it vectorises.
  const size_t total = size_t(n) * V;
  if (any_nan_or_posinf(x, total)) {
    for (size_t i = 0; i < total; ++i)
      if (x[i] != x[i]) throw InputError(cat("logits contain NaN (first at flat index ", i, ")"));
    throw InputError("logits contain +inf");
  }
  std::vector<int> first_max(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    first_max[size_t(r)] = first_max_of(x + size_t(r) * V, V);
    if (x[size_t(r) * V + first_max[size_t(r)]] == -T(INFINITY))
      throw InputError("a logits row is all -inf: nothing can be sampled");
  }
  for (int r = 0; r < n; ++r) {
    const T* row = x + size_t(r) * V;
    if (mask) row = masked(row, V, mask + size_t(r) * size_t(mask_words(V)), r);
    if (counts) row = penalised(row, V, *counts, p);  // penalties can move the maximum
    out[r] = sample_one(row, V, counts || mask ? first_max_of(row, V) : first_max[size_t(r)],
                        positions[r], p, threads);
  }
}

}  // namespace

template <class T>
void sample_rows(const T* x, int n, int V, const uint64_t* positions, const SampleParams& p,
                 int64_t* out, int threads, const uint32_t* mask) {
  check_sample_params(p);
  if (!p.penalised())
    return sample_counted(x, n, V, positions, p, nullptr, out, threads, mask);
  const Counts counts = count_history(p.history, V);
  sample_counted(x, n, V, positions, p, &counts, out, threads, mask);
}

Walk walk_tree(const float* logits, int V, const std::vector<int>& tokens,
               const std::vector<int>& parents, uint64_t base_position, const SampleParams& p,
               int threads, const uint32_t* masks) {
  check_sample_params(p);
  const int n = int(tokens.size());
  SW_CHECK(int(parents.size()) == n && n > 0, "walk: ", n, " tokens and ", parents.size(),
           " parents");
  // penalties count the history, then the path's tokens down to each node
  Counts counts;
  if (p.penalised()) counts = count_history(p.history, V);
  Walk w;
  int node = 0;
  for (uint64_t depth = 0;; ++depth) {
    int64_t pick;
    const uint64_t position = base_position + depth + 1;
    if (p.penalised()) {
      SW_CHECK(tokens[size_t(node)] >= 0 && tokens[size_t(node)] < V, "walk: token ",
               tokens[size_t(node)], " out of the vocabulary");
      ++counts[tokens[size_t(node)]];
    }
    sample_counted(logits + size_t(node) * V, 1, V, &position, p,
                   p.penalised() ? &counts : nullptr, &pick, threads,
                   masks ? masks + size_t(node) * size_t(mask_words(V)) : nullptr);
    w.path.push_back(node);
    w.picks.push_back(int(pick));
    int child = -1;
    for (int j = node + 1; j < n && child < 0; ++j)
      if (parents[size_t(j)] == node && tokens[size_t(j)] == pick) child = j;
    if (child < 0) return w;
    node = child;
  }
}

template void sample_rows<float>(const float*, int, int, const uint64_t*, const SampleParams&,
                                int64_t*, int, const uint32_t*);
template void sample_rows<double>(const double*, int, int, const uint64_t*, const SampleParams&,
                                 int64_t*, int, const uint32_t*);

}  // namespace sapwood
