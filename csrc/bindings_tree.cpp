// Bindings of the tree policy's per-round arithmetic (tree_growth.h): growing the best-first
// tree and its expected tokens, from arrays the Python policy keeps (policy.AcceptanceModel).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <type_traits>

#include "bindings_util.h"
#include "tree.h"
#include "tree_growth.h"

namespace py = pybind11;
using namespace sapwood;

namespace {

using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A numeric array of the given number of dimensions as contiguous `Array` (a converting copy
// where needed; float32 log-probabilities widen to double exactly).
template <class Array>
Array numeric(py::handle obj, const char* name, int ndim) {
  py::array a = py::array::ensure(obj);
  if (!a || a.ndim() != ndim)
    throw InputError(cat(name, " must be a ", ndim, "-D numeric array"));
  const char kind = a.dtype().kind();
  const bool want_float = std::is_floating_point_v<typename Array::value_type>;
  if (!(kind == 'i' || kind == 'u' || (want_float && kind == 'f')))
    throw InputError(cat(name, " must be ", want_float ? "numeric" : "integer", ", got dtype ",
                         std::string(py::str(a.dtype()))));
  return Array::ensure(a);
}

struct TableArrays {
  F64 chance, log_step, log_edges;
  AcceptanceTable view() const {
    return {chance.data(), log_step.data(), int(chance.shape(0)) - 1, int(chance.shape(1)),
            int(chance.shape(2)), log_edges.data()};
  }
};

TableArrays table_arrays(py::handle chance, py::handle log_step, py::handle log_edges) {
  // [depth groups + 1 (the last: off the drafter's line), ranks, buckets]
  TableArrays t{numeric<F64>(chance, "chance", 3), numeric<F64>(log_step, "log_step", 3),
                numeric<F64>(log_edges, "log_edges", 1)};
  SW_CHECK(t.chance.size() > 0, "chance table is empty");
  SW_CHECK(t.chance.shape(0) >= 2, "chance table has ", t.chance.shape(0),
           " groups: at least one depth group and the off-line one");
  for (int d = 0; d < 3; ++d)
    SW_CHECK(t.log_step.shape(d) == t.chance.shape(d), "log_step has shape ",
             shape_str(t.log_step), ", chance ", shape_str(t.chance));
  SW_CHECK(t.log_edges.shape(0) == t.chance.shape(2) - 1, "log_edges has ", t.log_edges.shape(0),
           " edges for ", t.chance.shape(2), " buckets");
  return t;
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(py::ssize_t(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

}  // namespace

void bind_tree_growth(py::module_& m) {
  m.def("grow_tree", [](int64_t root, py::handle tokens_obj, py::handle logprobs_obj,
                        py::handle counts_obj, int width, py::handle chance, py::handle log_step,
                        py::handle log_edges) {
    const TableArrays t = table_arrays(chance, log_step, log_edges);
    I64 tokens = numeric<I64>(tokens_obj, "lattice tokens", 2);
    F64 logprobs = numeric<F64>(logprobs_obj, "lattice logprobs", 2);
    const int rows = int(tokens.shape(0)), k = int(tokens.shape(1));
    SW_CHECK(logprobs.shape(0) == rows && logprobs.shape(1) == k, "lattice logprobs have shape ",
             shape_str(logprobs), ", tokens ", shape_str(tokens));
    std::vector<int> counts = counts_obj.is_none() ? std::vector<int>(rows, k)
                                                   : as_ints(counts_obj, "lattice counts");
    SW_CHECK(int(counts.size()) == rows, "lattice counts has ", counts.size(), " rows, tokens ", rows);
    for (int r = 0; r < rows; ++r)
      SW_CHECK(counts[r] >= 0 && counts[r] <= k, "lattice counts[", r, "] = ", counts[r],
               " out of [0, ", k, "]");
    GrownTree g = grow_best_first(root, tokens.data(), logprobs.data(), counts.data(), rows, k,
                                  width, t.view());
    return py::make_tuple(to_array(g.tokens), to_array(g.parents), to_array(g.depth),
                          to_array(g.rank), to_array(g.logp), to_array(g.q));
  }, py::arg("root"), py::arg("tokens"), py::arg("logprobs"), py::arg("counts"), py::arg("width"),
     py::arg("chance"), py::arg("log_step"), py::arg("log_edges"),
     "The best-first tree of `width` nodes over a lattice ([rows, k] tokens and log-probabilities, "
     "counts[r] candidates in row r or None for all) by calibrated chances: (tokens, parents, "
     "depth, rank, logp, q).");
  m.def("expected_tokens", [](py::handle parents_obj, py::handle depth_obj, py::handle rank_obj,
                              py::handle q_obj, py::handle chance, py::handle log_step,
                              py::handle log_edges) {
    const TableArrays t = table_arrays(chance, log_step, log_edges);
    I64 parents = numeric<I64>(parents_obj, "parents", 1), depth = numeric<I64>(depth_obj, "depth", 1),
        rank = numeric<I64>(rank_obj, "rank", 1);
    F64 q = numeric<F64>(q_obj, "q", 1);
    const int n = int(parents.shape(0));
    SW_CHECK(depth.shape(0) == n && rank.shape(0) == n && q.shape(0) == n,
             "parents, depth, rank and q lengths differ: ", n, ", ", depth.shape(0), ", ",
             rank.shape(0), ", ", q.shape(0));
    std::vector<int> p(parents.data(), parents.data() + n);
    check_parents(p.data(), n);
    for (int i = 1; i < n; ++i) {
      SW_CHECK(rank.data()[i] >= 0, "rank[", i, "] = ", rank.data()[i], " < 0");
      SW_CHECK(depth.data()[i] >= 1, "depth[", i, "] = ", depth.data()[i], " < 1");
    }
    return to_array(expected_tokens(parents.data(), depth.data(), rank.data(), q.data(), n,
                                    t.view()));
  }, py::arg("parents"), py::arg("depth"), py::arg("rank"), py::arg("q"), py::arg("chance"),
     py::arg("log_step"), py::arg("log_edges"),
     "E(w) of every prefix w of a tree under a calibrated chance table.");
}
