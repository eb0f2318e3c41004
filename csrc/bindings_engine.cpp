// pybind11 bindings of the Engine (sapwood._core.Engine). Arrays are checked here; errors
// become ValueError / MemoryError with the offending value; the GIL is released in compute.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings_util.h"
#include "common.h"
#include "engine.h"
#include "sampler.h"
#include "tree.h"

namespace py = pybind11;
using namespace sapwood;

namespace {

// The sampler's keyword arguments (sampling.SamplingParams' names, plus the penalties'
// history); an unknown one is an error, not ignored.
SampleParams sampling_kwargs(const py::dict& kw) {
  SampleParams p;
  for (const auto& [key, value] : kw) {
    const std::string k = py::str(key);
    if (k == "mask") continue;  // mask_kwarg's
    auto num = [&](auto* field) {
      try {
        *field = value.cast<std::remove_pointer_t<decltype(field)>>();
      } catch (const py::cast_error&) {
        throw InputError(cat(k, "=", std::string(py::repr(value)), ": must be a number"));
      }
    };
    if (k == "temperature") num(&p.temperature);
    else if (k == "top_k") num(&p.top_k);
    else if (k == "top_p") num(&p.top_p);
    else if (k == "min_p") num(&p.min_p);
    else if (k == "seed") num(&p.seed);
    else if (k == "repetition_penalty") num(&p.repetition_penalty);
    else if (k == "presence_penalty") num(&p.presence_penalty);
    else if (k == "frequency_penalty") num(&p.frequency_penalty);
    else if (k == "history") p.history = as_ints(value, "history");
    else throw InputError(cat("unknown sampling argument '", k, "'"));
  }
  check_sample_params(p);
  return p;
}

// The `mask` keyword (absent or None: no mask): allowed-token bitmasks [rows, mask_words(V)],
// int32 or uint32 (llguidance fills int32, the bits are what count), one row per row of
// logits. Returned as uint32 C-contiguous (empty when absent) to keep alive over the call.
py::array_t<uint32_t, py::array::c_style> mask_kwarg(const py::dict& kw, py::ssize_t rows,
                                                     py::ssize_t V) {
  if (!kw.contains("mask") || kw["mask"].is_none()) return py::array_t<uint32_t>();
  py::object m = kw["mask"];
  if (!py::isinstance<py::array>(m))
    throw InputError(cat("mask must be a numpy array of int32 or uint32 [rows, ceil(V/32)], got ",
                         std::string(py::str(py::type::of(m).attr("__name__")))));
  py::array a = py::reinterpret_borrow<py::array>(m);
  const char kind = a.dtype().kind();
  if (!((kind == 'i' || kind == 'u') && a.dtype().itemsize() == 4))
    throw InputError(cat("mask must be int32 or uint32 (bit i % 32 of word i / 32 allows id i), "
                         "got ", std::string(py::str(a.dtype()))));
  const py::ssize_t words = mask_words(int(V));
  if (a.ndim() != 2 || a.shape(0) != rows || a.shape(1) != words)
    throw InputError(cat("mask has shape ", shape_str(a), ", expected (", rows, ", ", words,
                         "): one row of ceil(V/32) words per row of logits (V = ", V, ")"));
  py::array c = py::array::ensure(a, py::array::c_style);
  // same bits, read as uint32
  return py::array_t<uint32_t, py::array::c_style>(
      {rows, words}, static_cast<const uint32_t*>(c.data()), c);
}

py::tuple walk_result(const Walk& w) {
  return py::make_tuple(py::cast(w.path), py::cast(w.picks));
}

}  // namespace

void bind_engine(py::module_& m) {
  m.def("available_backends", &available_backends,
        "The backends this build has: 'cpu', then 'metal', 'metal-emulated', 'sycl', "
        "'sycl-emulated' as built.");
  m.def("sample", [](py::array logits, py::array_t<uint64_t, py::array::c_style> positions,
                     const py::kwargs& kw) {
          // sampling.sample has checked the parameters and the shapes
          if (logits.ndim() != 2 || positions.ndim() != 1 || positions.shape(0) != logits.shape(0))
            throw InputError(cat("sample: logits [N, V] and positions [N], got ",
                                 shape_str(logits), " and ", shape_str(positions)));
          const int n = int(logits.shape(0)), V = int(logits.shape(1));
          const SampleParams p = sampling_kwargs(kw);
          const auto mask = mask_kwarg(kw, n, V);
          const uint32_t* mk = mask.size() ? mask.data() : nullptr;
          py::array_t<int64_t> out(n);
          int64_t* o = out.mutable_data();
          const uint64_t* pos = positions.data();
          auto run = [&](auto* x) {
            py::gil_scoped_release release;
            sample_rows(x, n, V, pos, p, o, 0, mk);
          };
          if (py::isinstance<py::array_t<float, py::array::c_style>>(logits))
            run(py::array_t<float, py::array::c_style>(logits).data());
          else if (py::isinstance<py::array_t<double, py::array::c_style>>(logits))
            run(py::array_t<double, py::array::c_style>(logits).data());
          else
            throw InputError(cat("sample: logits must be C-contiguous float32 or float64, got ",
                                 std::string(py::str(logits.dtype()))));
          return out;
        },
        py::arg("logits"), py::arg("positions"),
        "The keyed sampler (sampler.h) over rows [N, V] at positions [N], keyword arguments "
        "as SamplingParams' (and history, the tokens penalties count; mask, allowed-token "
        "bitmasks [N, ceil(V/32)] int32/uint32): sampling.sample's work.");
  m.def("walk", [](py::array_t<float, py::array::c_style> logits, py::handle tokens,
                   py::handle parents, uint64_t base_position, const py::kwargs& kw) {
          const std::vector<int> t = as_ints(tokens, "tokens"), par = as_ints(parents, "parents");
          check_parents(par.data(), int(par.size()));
          if (logits.ndim() != 2 || logits.shape(0) != py::ssize_t(t.size()) ||
              par.size() != t.size() || logits.shape(1) == 0)
            throw InputError(cat("walk: logits [N, V] for N tokens and parents, got ",
                                 shape_str(logits), ", ", t.size(), " tokens and ", par.size(),
                                 " parents"));
          const SampleParams p = sampling_kwargs(kw);
          const auto mask = mask_kwarg(kw, logits.shape(0), logits.shape(1));
          Walk w;
          {
            py::gil_scoped_release release;
            w = walk_tree(logits.data(), int(logits.shape(1)), t, par, base_position, p, 0,
                          mask.size() ? mask.data() : nullptr);
          }
          return walk_result(w);
        },
        py::arg("logits"), py::arg("tokens"), py::arg("parents"), py::arg("base_position"),
        "(path, picks): the walk of a verified tree over its logits [N, V] from the root at "
        "base_position (Engine.verify_walk's, over logits given); mask= one bitmask row per node.");
  py::register_exception<EngineBusy>(m, "EngineBusyError", PyExc_RuntimeError);
  py::class_<Snapshot, std::shared_ptr<Snapshot>>(m, "Snapshot")
      .def_property_readonly("position", [](const Snapshot& s) { return s.length; })
      .def_property_readonly("model_id", [](const Snapshot& s) { return s.model_id; });

  m.def("verify_many", [](py::handle items) {
          std::vector<Engine*> engines;
          std::vector<std::vector<int>> tokens, parents;
          if (!py::isinstance<py::sequence>(items) || py::isinstance<py::str>(items))
            throw InputError("verify_many: items must be a list of (engine, tokens, parents)");
          py::sequence seq = py::reinterpret_borrow<py::sequence>(items);
          for (size_t i = 0; i < seq.size(); ++i) {
            py::handle it = seq[i];
            if (!py::isinstance<py::tuple>(it) && !py::isinstance<py::list>(it))
              throw InputError(cat("verify_many: item ", i, " must be (engine, tokens, parents)"));
            py::sequence t = py::reinterpret_borrow<py::sequence>(it);
            if (t.size() != 3)
              throw InputError(cat("verify_many: item ", i, " must be (engine, tokens, parents), got ",
                                   t.size(), " values"));
            try {
              engines.push_back(t[0].cast<Engine*>());
            } catch (const py::cast_error&) {
              throw InputError(cat("verify_many: item ", i, "'s first value is not an Engine"));
            }
            tokens.push_back(as_ints(t[1], "tokens"));
            parents.push_back(as_ints(t[2], "parents"));
          }
          std::vector<std::vector<float>> out;
          {
            py::gil_scoped_release release;
            out = Engine::verify_many(engines, tokens, parents);
          }
          py::list res;
          for (size_t i = 0; i < out.size(); ++i)
            res.append(to_array(std::move(out[i]), py::ssize_t(tokens[i].size()),
                                engines[i]->dims().vocab));
          return res;
        },
        py::arg("items"),
        "Verify several sequences' trees in one forward: items is [(engine, tokens, parents), "
        "...] over engines of one model (new_sequence), each at most once. Returns each one's "
        "logits [N_i, V], the bits its own verify() gives; each then commits its own path.");

  py::class_<Engine>(m, "Engine")
      .def(py::init([](py::dict dims, py::handle weights, const std::string& wfmt,
                       const std::string& kv, int max_context, int threads,
                       const std::string& backend) {
             ModelDims d = parse_dims(dims);
             WeightsArg t(weights);
             WFormat f = parse_wformat(wfmt.c_str());
             KVDtype k = parse_kv_dtype(kv);
             py::gil_scoped_release release;
             return std::make_unique<Engine>(d, *t.src, f, k, max_context, threads, 64, backend);
           }),
           py::arg("dims"), py::arg("weights"), py::arg("weights_format") = "q8",
           py::arg("kv") = "int8", py::arg("max_context") = 4096, py::arg("threads") = 0,
           py::arg("backend") = "cpu")
      .def("new_sequence", [](const Engine& e, int max_context, int threads) {
             py::gil_scoped_release release;
             return std::make_unique<Engine>(e, max_context, threads);
           },
           py::arg("max_context") = 0, py::arg("threads") = 0,
           "Another sequence of this engine's model: the same weights (one copy, on a GPU "
           "backend the same device buffers), its own empty state. max_context and threads: 0 "
           "takes this engine's. Its rows and this one's can be verified in one forward "
           "(verify_many); snapshots move between them.")
      .def("shares_weights", &Engine::shares_weights, py::arg("other"),
           "Whether the two engines run one copy of the weights (new_sequence).")
      .def("prefill", [](Engine& e, py::handle tokens, bool all_logits) {
             std::vector<int> t = as_ints(tokens, "tokens");
             std::vector<float> out;
             {
               py::gil_scoped_release release;
               out = e.prefill(t, all_logits);
             }
             const int V = e.dims().vocab;
             return to_array(std::move(out), all_logits ? py::ssize_t(t.size()) : -1, V);
           },
           py::arg("tokens"), py::arg("all_logits") = false,
           "Commit the tokens; logits of the last row [V] (or of every row [T, V]).")
      .def("verify", [](Engine& e, py::handle tokens, py::handle parents) {
             std::vector<int> t = as_ints(tokens, "tokens"), p = as_ints(parents, "parents");
             std::vector<float> out;
             {
               py::gil_scoped_release release;
               out = e.verify(t, p);
             }
             return to_array(std::move(out), py::ssize_t(t.size()), e.dims().vocab);
           },
           py::arg("tokens"), py::arg("parents"),
           "Logits [N, V] of a tree; node 0 is the root at the current position.")
      .def("verify_walk", [](Engine& e, py::handle tokens, py::handle parents, bool commit,
                             bool fold_in_background, bool return_logits,
                             const py::kwargs& kw) {
             const std::vector<int> t = as_ints(tokens, "tokens");
             const std::vector<int> p = as_ints(parents, "parents");
             const SampleParams sp = sampling_kwargs(kw);
             const auto mask = mask_kwarg(kw, py::ssize_t(t.size()), e.dims().vocab);
             std::vector<float> z;
             Walk w;
             {
               py::gil_scoped_release release;
               w = e.verify_walk(t, p, sp, commit, fold_in_background,
                                 return_logits ? &z : nullptr,
                                 mask.size() ? mask.data() : nullptr);
             }
             py::tuple res = walk_result(w);
             if (!return_logits) return res;
             return py::tuple(py::make_tuple(
                 res[0], res[1], to_array(std::move(z), py::ssize_t(t.size()), e.dims().vocab)));
           },
           py::arg("tokens"), py::arg("parents"), py::arg("commit") = true,
           py::arg("fold_in_background") = false, py::arg("logits") = false,
           "A round in one call: verify the tree, walk it (at each node of the path the pick "
           "at its position: keyed sample, or argmax at temperature 0; then the child carrying "
           "it), commit the path (unless commit=False). Sampling keyword arguments as "
           "SamplingParams' names, plus history (the context penalties count; the walk adds "
           "the path), and mask (allowed-token bitmasks [N, ceil(V/32)], one row per node: its "
           "pick is drawn among the allowed ids). Returns (path, picks), and the logits [N, V] "
           "last when logits=True.")
      .def("commit", [](Engine& e, py::handle path, bool fold_in_background) {
             std::vector<int> p = as_ints(path, "path");
             py::gil_scoped_release release;
             e.commit(p, fold_in_background);
           }, py::arg("path"), py::arg("fold_in_background") = false,
           "Commit a path of the last verify's tree (node indices from the root). "
           "fold_in_background: fold its GDN steps on a pool worker while the caller goes on "
           "(e.g. drafts); the next call touching that state waits. Same results either way.")
      .def("draft_chain", [](Engine& e, int root, int rows, double temperature, uint64_t seed,
                             py::handle prefix) {
             const std::vector<int> pre = as_ints(prefix, "prefix");
             std::vector<float> out;
             {
               py::gil_scoped_release release;
               out = e.draft_chain(root, rows, temperature, seed, nullptr, pre);
             }
             return to_array(std::move(out), py::ssize_t(rows), e.dims().vocab);
           },
           py::arg("root"), py::arg("rows"), py::arg("temperature") = 0.0, py::arg("seed") = 0,
           py::arg("prefix") = py::tuple(),
           "Logits [rows, V] along the chain from root (greedy, or keyed samples at temperature "
           "> 0); committed state unchanged, except `prefix` (at most max_draft_prefix context "
           "tokens), committed first in the chain's first forward.")
      .def("draft_candidates", [](Engine& e, int root, int rows, int k, double temperature,
                                  uint64_t seed, py::handle prefix, py::handle keep) {
             const std::vector<int> pre = as_ints(prefix, "prefix");
             const std::vector<int> kept = as_ints(keep, "keep");
             std::vector<int> ids;
             std::vector<double> logp;
             {
               py::gil_scoped_release release;
               e.draft_candidates(root, rows, k, temperature, seed, &ids, &logp, pre, kept);
             }
             const py::ssize_t kk = py::ssize_t(ids.size() / size_t(rows));
             py::array_t<int64_t> ids_a({py::ssize_t(rows), kk});
             py::array_t<double> logp_a({py::ssize_t(rows), kk});
             std::copy(ids.begin(), ids.end(), ids_a.mutable_data());
             std::copy(logp.begin(), logp.end(), logp_a.mutable_data());
             return py::make_tuple(ids_a, logp_a);
           },
           py::arg("root"), py::arg("rows"), py::arg("k"), py::arg("temperature") = 0.0,
           py::arg("seed") = 0, py::arg("prefix") = py::tuple(), py::arg("keep") = py::tuple(),
           "(ids [rows, k], log-probabilities [rows, k]) of the draft chain: per row the chain's "
           "pick first, then the other most likely ids; committed state unchanged but for "
           "`prefix` (as draft_chain) or `keep` (the target's tokens since the last chain: "
           "keep_draft(keep), the rest committed first).")
      .def_property_readonly("max_draft_prefix", &Engine::max_draft_prefix)
      .def("keep_draft", [](Engine& e, const std::vector<int>& tokens) {
             py::gil_scoped_release release;
             return e.keep_draft(tokens);
           }, py::arg("tokens"),
           "After draft_chain/draft_candidates: commit the longest prefix of `tokens` equal to the "
           "chain's processed tokens (root, a1, ...) from the states the chain kept; returns its "
           "length m (prefill tokens[m:] next). Any other call drops what the chain kept.")
      .def("reset", &Engine::reset)
      .def_property("keep_hidden", &Engine::keep_hidden, &Engine::set_keep_hidden,
                    "Keep the final hidden rows of committed positions for take_hidden() (the "
                    "MTP drafter); setting it drops what was kept.")
      .def("take_hidden", [](Engine& e) {
             std::vector<float> rows;
             const int from = e.take_hidden(&rows);
             const py::ssize_t H = e.dims().hidden, n = py::ssize_t(rows.size()) / H;
             return py::make_tuple(from, to_array(std::move(rows), n, H));
           },
           "(position of the first row, rows [n, hidden]): the final hidden states (after "
           "model.norm) of the positions committed since the last take, while keep_hidden.")
      .def("fill_synthetic", [](Engine& e, int n, uint64_t seed) {
             py::gil_scoped_release release;
             e.fill_synthetic(n, seed);
           }, py::arg("n"), py::arg("seed") = 0,
           "Benchmarks only: append n positions of random K/V without computing them.")
      .def("snapshot", &Engine::snapshot)
      .def("restore", &Engine::restore, py::arg("snapshot"))
      .def_property_readonly("position", &Engine::position)
      .def_property_readonly("max_context", &Engine::max_context)
      .def_property_readonly("model_id", &Engine::model_id,
                             "Hash of the dims, weights, weight format, KV dtype and page size.")
      .def_property_readonly_static("max_verify_nodes",
                                    [](py::object) { return Engine::kMaxVerifyNodes; })
      .def_property_readonly("vocab_size", [](const Engine& e) { return e.dims().vocab; })
      .def_property_readonly("threads", &Engine::threads)
      .def_property_readonly("backend", &Engine::backend)
      .def_property_readonly("syncs", &Engine::syncs,
                             "How often the host has waited for the backend's device so far "
                             "(0 on the CPU): a round's count is the difference.")
      .def("memory", [](const Engine& e) {
        py::dict d;
        d["weights_bytes"] = e.weight_bytes();
        d["kv_pool_bytes"] = e.kv_bytes();
        d["kv_used_bytes"] = e.kv_bytes_used();
        d["gdn_state_bytes"] = e.gdn_state_bytes();
        return d;
      });
}
