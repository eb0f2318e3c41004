// pybind11 bindings of the MTP head (sapwood._core.MtpHead): arrays checked here, the GIL
// released in compute. The head keeps its target Engine alive (it reads its embedding table
// and LM head).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings_util.h"
#include "common.h"
#include "mtp.h"

namespace py = pybind11;
using namespace sapwood;

namespace {

std::vector<float> hidden_rows(py::handle hidden, int H) {
  F32 a = as_f32(hidden, "hidden", {-1, H});
  return std::vector<float>(a.data(), a.data() + a.size());
}

}  // namespace

void bind_mtp(py::module_& m) {
  py::class_<MtpHead>(m, "MtpHead")
      .def(py::init([](const Engine& target, py::handle weights, const std::string& wfmt,
                       const std::string& kv, int max_context, int threads,
                       const std::string& backend) {
             WeightsArg t(weights);
             WFormat f = parse_wformat(wfmt.c_str());
             KVDtype k = parse_kv_dtype(kv);
             py::gil_scoped_release release;
             return std::make_unique<MtpHead>(target, *t.src, f, k, max_context, threads, 64, backend);
           }),
           py::arg("target"), py::arg("weights"), py::arg("weights_format") = "q8",
           py::arg("kv") = "int8", py::arg("max_context") = 4096, py::arg("threads") = 0,
           py::arg("backend") = "cpu", py::keep_alive<1, 2>(),
           "The checkpoint's MTP head over the target engine (weights: the mtp.* tensors by "
           "their checkpoint names).")
      .def("prefill", [](MtpHead& h, py::handle hidden, py::handle tokens, bool all_logits) {
             const std::vector<int> t = as_ints(tokens, "tokens");
             const int H = int(h.hidden_size());
             const std::vector<float> x = hidden_rows(hidden, H);
             std::vector<float> out, out_h;
             {
               py::gil_scoped_release release;
               out = h.prefill(x, t, all_logits, &out_h);
             }
             const py::ssize_t n = py::ssize_t(out_h.size()) / H;
             return py::make_tuple(to_array(std::move(out), all_logits ? n : -1, h.vocab_size()),
                                   to_array(std::move(out_h), n, H));
           },
           py::arg("hidden"), py::arg("tokens"), py::arg("all_logits") = false,
           "Commit rows (hidden [n, H]: the target's final hidden states; tokens [n]: the token "
           "after each): (logits of the last row [V] or of every row [n, V], the head's output "
           "hidden rows of the same rows).")
      .def("draft", [](MtpHead& h, py::handle hidden, py::handle tokens, int rows, int k,
                       double temperature, uint64_t seed, uint64_t key_position,
                       bool logits) -> py::tuple {
             const std::vector<int> t = as_ints(tokens, "tokens");
             const std::vector<float> x = hidden_rows(hidden, int(h.hidden_size()));
             std::vector<int> ids;
             std::vector<double> logp;
             std::vector<float> z;
             {
               py::gil_scoped_release release;
               h.draft(x, t, rows, k, temperature, seed, key_position, &ids, &logp,
                       logits ? &z : nullptr);
             }
             const py::ssize_t kk = py::ssize_t(ids.size() / size_t(rows));
             py::array_t<int64_t> ids_a({py::ssize_t(rows), kk});
             py::array_t<double> logp_a({py::ssize_t(rows), kk});
             std::copy(ids.begin(), ids.end(), ids_a.mutable_data());
             std::copy(logp.begin(), logp.end(), logp_a.mutable_data());
             if (!logits) return py::make_tuple(ids_a, logp_a);
             return py::make_tuple(ids_a, logp_a, to_array(std::move(z), rows, h.vocab_size()));
           },
           py::arg("hidden"), py::arg("tokens"), py::arg("rows"), py::arg("k"),
           py::arg("temperature") = 0.0, py::arg("seed") = 0, py::arg("key_position") = 0,
           py::arg("logits") = false,
           "Commit the rows as prefill (the last one's token is the root), then draft `rows` "
           "rows: (ids [rows, k], log-probabilities [rows, k][, logits [rows, V]]), per row "
           "the chain's pick first (argmax, or the keyed sample of the token at key_position "
           "+ row), then the other most likely ids. The drafted rows are rolled back.")
      .def("draft_target", [](MtpHead& h, Engine& target, py::handle tail, int tail_start,
                              int root, int rows, int k, double temperature,
                              uint64_t seed) -> py::object {
             const std::vector<int> t = as_ints(tail, "tail");
             std::vector<int> ids;
             std::vector<double> logp;
             int need = -1;
             bool drafted;
             {
               py::gil_scoped_release release;
               drafted = h.draft_target(target, t, tail_start, root, rows, k, temperature, seed,
                                        &ids, &logp, &need);
             }
             if (!drafted) return need >= 0 ? py::object(py::int_(need)) : py::object(py::none());
             const py::ssize_t kk = std::min(k, h.vocab_size()), r = py::ssize_t(ids.size()) / kk;
             py::array_t<int64_t> ids_a({r, kk});
             py::array_t<double> logp_a({r, kk});
             std::copy(ids.begin(), ids.end(), ids_a.mutable_data());
             std::copy(logp.begin(), logp.end(), logp_a.mutable_data());
             return py::make_tuple(ids_a, logp_a);
           },
           py::arg("target"), py::arg("tail"), py::arg("tail_start"), py::arg("root"),
           py::arg("rows"), py::arg("k"), py::arg("temperature") = 0.0, py::arg("seed") = 0,
           "A drafter's round in one call (the target engine's hidden rows taken here): "
           "(ids [rows, k], log-probabilities) as draft(); None when there is nothing to draft "
           "from; an int when `tail` (the target's context from tail_start) starts too late: "
           "call again with the context from that position.")
      .def("reset", &MtpHead::reset)
      .def_property_readonly("position", &MtpHead::position)
      .def_property_readonly("max_context", &MtpHead::max_context)
      .def_property_readonly("weight_bytes", &MtpHead::weight_bytes);
}
