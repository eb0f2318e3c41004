// sapwood._core.BackendOps: the op list of backend.h, one op a call, on any backend this build
// has, so that one test (tests/test_backend_ops.py, after ggml's test-backend-ops) runs the same
// cases against the same numpy references on the CPU (per ISA) and on every GPU device.
//
// It holds a model's weights, loaded as the engine loads them (load_weights, in the weight
// format asked for), and the backend made for them: the ops read those matrices and vectors,
// named by their checkpoint names, exactly as a forward does (a GPU backend uploads them in its
// own layout at construction). Inputs go in with upload, results come out with download (the
// backend's sync point). The stateful ops run a forward's worth of one sequence's state: the
// attention layer's kv_rows + attend and the GDN layer's gdn over one layout (prefill, or a tree
// verify against the committed state), then commit(path).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "backend.h"
#include "bindings_util.h"
#include "common.h"
#include "engine.h"
#include "exclusive.h"
#include "tree.h"

namespace py = pybind11;
using namespace sapwood;

namespace {

class BackendOps {
 public:
  BackendOps(const ModelDims& d, TensorSource& t, WFormat f, const std::string& backend,
             int max_context)
      : d_(d), w_(load(d_, t, f)),
        be_(make_backend(backend, d_, w_, KVDtype::Int8, max_context, 64, 1)) {}

  static ModelWeights load(const ModelDims& d, TensorSource& t, WFormat f) {
    WeightLoader loader(t, 1);
    return load_weights(d, loader, f);
  }
  Backend& be() { return *be_; }
  const ModelDims& dims() const { return d_; }
  std::vector<int> tape_parents;  // the last tree forward's (empty: nothing to commit)
  // Held by every op (exclusive.h): the ops run with the GIL, but converting an argument can
  // run Python code and let a second thread in, whose op would move the scratch buffers and
  // the state this one is using.
  Exclusive exclusive;

  // A matrix of the model by checkpoint name ("model.layers.{l}.linear_attn.in_proj_ba" is the
  // fused b|a matrix the loader builds).
  const QMatrix& matrix(const std::string& name) const {
    if (name == "model.embed_tokens.weight") return w_.embed;
    if (name == "lm_head.weight") return w_.head();
    const auto [L, leaf] = layer_of(name);
    static const std::pair<const char*, QMatrix LayerWeights::*> kNames[] = {
        {"mlp.gate_proj.weight", &LayerWeights::gate}, {"mlp.up_proj.weight", &LayerWeights::up},
        {"mlp.down_proj.weight", &LayerWeights::down},
        {"linear_attn.in_proj_qkv.weight", &LayerWeights::qkv},
        {"linear_attn.in_proj_z.weight", &LayerWeights::z},
        {"linear_attn.out_proj.weight", &LayerWeights::out},
        {"linear_attn.in_proj_ba", &LayerWeights::ba}, {"self_attn.q_proj.weight", &LayerWeights::q},
        {"self_attn.k_proj.weight", &LayerWeights::k}, {"self_attn.v_proj.weight", &LayerWeights::v},
        {"self_attn.o_proj.weight", &LayerWeights::o}};
    for (const auto& [n, member] : kNames)
      if (leaf == n && (L->*member).rows) return L->*member;
    throw InputError(cat("no matrix '", name, "' in this model"));
  }

  // A vector of the model by checkpoint name, as the loader keeps it: the zero-centred norms as
  // (1 + w), A_log as -exp(A_log), the gated norm's w and dt_bias as they are.
  const std::vector<float>& vector(const std::string& name) const {
    if (name == "model.norm.weight") return w_.final_norm;
    const auto [L, leaf] = layer_of(name);
    static const std::pair<const char*, std::vector<float> LayerWeights::*> kNames[] = {
        {"input_layernorm.weight", &LayerWeights::in_norm},
        {"post_attention_layernorm.weight", &LayerWeights::post_norm},
        {"self_attn.q_norm.weight", &LayerWeights::q_norm},
        {"self_attn.k_norm.weight", &LayerWeights::k_norm},
        {"linear_attn.norm.weight", &LayerWeights::gnorm},
        {"linear_attn.A_log", &LayerWeights::neg_exp_a},
        {"linear_attn.dt_bias", &LayerWeights::dt_bias}};
    for (const auto& [n, member] : kNames)
      if (leaf == n && !(L->*member).empty()) return L->*member;
    throw InputError(cat("no vector '", name, "' in this model"));
  }

  // Host floats into scratch buffer `id` (a Forward::Buf, so no op's output aliases it).
  Act put(int id, const float* x, size_t n) {
    Act a = be_->scratch(id, std::max<size_t>(n, 1));
    be_->upload(a, x, n);
    return a;
  }
  std::vector<float> get(Act a, size_t n) {
    std::vector<float> out(n);
    be_->download(a, n, out.data());
    return out;
  }

 private:
  std::pair<const LayerWeights*, std::string> layer_of(const std::string& name) const {
    const std::string pre = "model.layers.";
    size_t dot = name.find('.', pre.size());
    if (name.compare(0, pre.size(), pre) == 0 && dot != std::string::npos) {
      const std::string idx = name.substr(pre.size(), dot - pre.size());
      if (!idx.empty() && idx.size() < 6 && std::all_of(idx.begin(), idx.end(), ::isdigit)) {
        const int l = std::stoi(idx);
        if (l < d_.n_layers()) return {&w_.layers[l], name.substr(dot + 1)};
      }
    }
    throw InputError(cat("'", name, "' names no layer of this model"));
  }

  ModelDims d_;
  ModelWeights w_;
  std::unique_ptr<Backend> be_;
};

constexpr const char* kOpsBusy =
    "BackendOps is in use by another thread: it runs one op at a time (give each thread its "
    "own, or serialise the calls)";
constexpr const char* kOpsReentered =
    "BackendOps is in use: an op was called from inside another (an argument's conversion "
    "ran Python code that called it); its ops do not nest";

size_t rows_of(const F32& x) { return x.ndim() ? size_t(x.shape(0)) : 0; }

py::array_t<float> shaped(std::vector<float>&& v, const F32& like) {
  std::vector<py::ssize_t> shape(like.shape(), like.shape() + like.ndim());
  py::array_t<float> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

}  // namespace

void bind_backend_ops(py::module_& m) {
  using B = Forward::Buf;
  py::class_<BackendOps>(m, "BackendOps",
                         "The backend op list one op a call (tests/test_backend_ops.py): the "
                         "model's weights loaded in `weights_format` on `backend`, the ops reading "
                         "them by checkpoint name, one sequence's KV and GDN state.")
      .def(py::init([](py::dict dims, py::handle weights, const std::string& wfmt,
                       const std::string& backend, int max_context) {
             ModelDims d = parse_dims(dims);
             WeightsArg t(weights);
             WFormat f = parse_wformat(wfmt.c_str());
             py::gil_scoped_release release;
             return std::make_unique<BackendOps>(d, *t.src, f, backend, max_context);
           }),
           py::arg("dims"), py::arg("weights"), py::arg("weights_format"), py::arg("backend"),
           py::arg("max_context") = 256)
      .def_property_readonly("backend", [](BackendOps& o) { return o.be().name(); })
      .def_property_readonly("length", [](BackendOps& o) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        return o.be().length();
      })
      .def("embed", [](BackendOps& o, py::handle tokens) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        const std::vector<int> t = as_ints(tokens, "tokens");
        const int n = int(t.size()), H = o.dims().hidden;
        Act x = o.be().scratch(B::kX, size_t(n) * H);
        o.be().embed(o.matrix("model.embed_tokens.weight"), t.data(), n, x);
        return to_array(o.get(x, size_t(n) * H), n, H);
      }, py::arg("tokens"))
      .def("rms_norm", [](BackendOps& o, py::handle x_obj, const std::string& weight) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        const std::vector<float>& w = o.vector(weight);
        F32 x = as_f32(x_obj, "x", {-1, py::ssize_t(w.size())});
        const int n = int(rows_of(x)), dim = int(w.size());
        Act a = o.put(B::kX, x.data(), x.size()), out = o.be().scratch(B::kH, x.size());
        o.be().rms_norm(a, w, n, dim, o.dims().eps, out);
        return shaped(o.get(out, x.size()), x);
      }, py::arg("x"), py::arg("weight"))
      .def("add", [](BackendOps& o, py::handle x_obj, py::handle y_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        F32 x = as_f32(x_obj, "x", {-1}), y = as_f32(y_obj, "y", {x.shape(0)});
        Act a = o.put(B::kX, x.data(), x.size()), b = o.put(B::kMix, y.data(), y.size());
        o.be().add(a, b, x.size());
        return shaped(o.get(a, x.size()), x);
      }, py::arg("x"), py::arg("y"), "x + y")
      .def("copy", [](BackendOps& o, py::handle x_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        F32 x = as_f32(x_obj, "x", {-1});
        Act a = o.put(B::kX, x.data(), x.size()), out = o.be().scratch(B::kMix, x.size());
        o.be().copy(out, a, x.size());
        return shaped(o.get(out, x.size()), x);
      }, py::arg("x"), "a copy through the backend's device copy")
      .def("top_k_rows", [](BackendOps& o, py::handle x_obj, int k) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        F32 x = as_f32(x_obj, "x", {-1, -1}, false);  // NaN and -inf rows have their rules
        const int rows = int(x.shape(0)), cols = int(x.shape(1));
        SW_CHECK(rows >= 1 && cols >= 1, "top_k_rows of an empty array");
        Act a = o.put(B::kLogits, x.data(), x.size());
        Act out = o.be().scratch(B::kDraftPick, size_t(2) * rows * k);
        o.be().top_k_rows(a, rows, cols, k, out, out + size_t(rows) * k);
        const std::vector<float> got = o.get(out, size_t(2) * rows * k);
        py::array_t<int32_t> ids({rows, k});
        py::array_t<float> vals({rows, k});
        std::memcpy(ids.mutable_data(), got.data(), size_t(rows) * k * 4);  // int32 bits
        std::memcpy(vals.mutable_data(), got.data() + size_t(rows) * k, size_t(rows) * k * 4);
        return py::make_tuple(ids, vals);
      }, py::arg("x"), py::arg("k"), "(ids, values) [rows, k]: each row's k best, best first")
      .def("logsumexp_rows", [](BackendOps& o, py::handle x_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        F32 x = as_f32(x_obj, "x", {-1, -1});
        const int rows = int(x.shape(0)), cols = int(x.shape(1));
        SW_CHECK(rows >= 1 && cols >= 1, "logsumexp_rows of an empty array");
        Act a = o.put(B::kLogits, x.data(), x.size());
        Act out = o.be().scratch(B::kDraftPick, size_t(rows));
        o.be().logsumexp_rows(a, rows, cols, out);
        return to_array(o.get(out, size_t(rows)), -1, rows);
      }, py::arg("x"))
      .def("silu_mul", [](BackendOps& o, py::handle x_obj, py::handle u_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        F32 x = as_f32(x_obj, "x", {-1}), u = as_f32(u_obj, "u", {x.shape(0)});
        Act a = o.put(B::kGate, x.data(), x.size()), b = o.put(B::kUp, u.data(), u.size());
        Act out = o.be().scratch(B::kMix, x.size());
        o.be().silu_mul(a, b, out, x.size());
        return shaped(o.get(out, x.size()), x);
      }, py::arg("x"), py::arg("u"), "silu(x) * u")
      .def("sigmoid_mul", [](BackendOps& o, py::handle x_obj, py::handle u_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        F32 x = as_f32(x_obj, "x", {-1}), u = as_f32(u_obj, "u", {x.shape(0)});
        Act a = o.put(B::kGate, x.data(), x.size()), b = o.put(B::kUp, u.data(), u.size());
        Act out = o.be().scratch(B::kMix, x.size());
        o.be().sigmoid_mul(a, b, out, x.size());
        return shaped(o.get(out, x.size()), x);
      }, py::arg("x"), py::arg("u"), "sigmoid(x) * u")
      .def("split_q_gate", [](BackendOps& o, py::handle qg_obj, int heads, int dim) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        SW_CHECK(heads > 0 && dim > 0, "heads and dim must be positive");
        F32 qg = as_f32(qg_obj, "qg", {-1, py::ssize_t(heads) * 2 * dim});
        const int n = int(rows_of(qg));
        const size_t half = size_t(n) * heads * dim;
        Act a = o.put(B::kQG, qg.data(), qg.size());
        Act q = o.be().scratch(B::kQ, half), g = o.be().scratch(B::kAttGate, half);
        o.be().split_q_gate(a, n, heads, dim, q, g);
        return py::make_tuple(to_array(o.get(q, half), n, py::ssize_t(heads) * dim),
                              to_array(o.get(g, half), n, py::ssize_t(heads) * dim));
      }, py::arg("qg"), py::arg("heads"), py::arg("dim"), "(q, gate) [n, heads * dim]")
      .def("rope", [](BackendOps& o, py::handle x_obj, int rot, py::handle cs_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        F32 x = as_f32(x_obj, "x", {-1, -1, -1});
        const int n = int(x.shape(0)), heads = int(x.shape(1)), dim = int(x.shape(2));
        SW_CHECK(rot > 0 && rot % 2 == 0 && rot <= dim, "rot = ", rot, " must be even and in (0, ", dim, "]");
        F32 cs = as_f32(cs_obj, "cs", {n, rot / 2, 2});
        Act a = o.put(B::kQ, x.data(), x.size()), c = o.put(B::kRope, cs.data(), cs.size());
        o.be().rope(a, n, heads, dim, rot, c);
        return shaped(o.get(a, x.size()), x);
      }, py::arg("x"), py::arg("rot"), py::arg("cs"),
         "rotate-half on the first rot dims of each head; cs [n, rot/2, (cos, sin)]")
      .def("gdn_gates", [](BackendOps& o, py::handle ba_obj, int layer) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        const std::string p = cat("model.layers.", layer, ".linear_attn.");
        const std::vector<float>& nea = o.vector(p + "A_log");
        const std::vector<float>& dtb = o.vector(p + "dt_bias");
        const int hv = int(nea.size());
        F32 ba = as_f32(ba_obj, "ba", {-1, 2 * hv});
        const int n = int(rows_of(ba));
        Act a = o.put(B::kBA, ba.data(), ba.size());
        Act beta = o.be().scratch(B::kBeta, size_t(n) * hv), g = o.be().scratch(B::kDecay, size_t(n) * hv);
        o.be().gdn_gates(a, n, hv, nea, dtb, beta, g);
        return py::make_tuple(to_array(o.get(beta, size_t(n) * hv), n, hv),
                              to_array(o.get(g, size_t(n) * hv), n, hv));
      }, py::arg("ba"), py::arg("layer"), "(beta, g) [n, hv] with the layer's A_log and dt_bias")
      .def("matmul", [](BackendOps& o, py::handle x_obj, const std::vector<std::string>& names) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        SW_CHECK(!names.empty() && names.size() <= 3, "1 to 3 matrices share x, got ", names.size());
        std::vector<const QMatrix*> ms;
        for (const std::string& nm : names) ms.push_back(&o.matrix(nm));
        for (const QMatrix* q : ms)
          SW_CHECK(q->cols == ms[0]->cols && q->fmt == ms[0]->fmt,
                   "matrices sharing x need the same width and format");
        F32 x = as_f32(x_obj, "x", {-1, ms[0]->cols});
        const int n = int(rows_of(x));
        SW_CHECK(n > 0 && n <= Engine::kMaxVerifyNodes, "x has ", n, " rows");
        Act a = o.put(B::kH, x.data(), x.size());
        const int ids[] = {B::kGate, B::kUp, B::kMix};
        std::vector<Act> ys;
        for (size_t i = 0; i < ms.size(); ++i) ys.push_back(o.be().scratch(ids[i], size_t(n) * ms[i]->rows));
        if (ms.size() == 1) o.be().matmul(a, n, {{ms[0], ys[0]}});
        if (ms.size() == 2) o.be().matmul(a, n, {{ms[0], ys[0]}, {ms[1], ys[1]}});
        if (ms.size() == 3) o.be().matmul(a, n, {{ms[0], ys[0]}, {ms[1], ys[1]}, {ms[2], ys[2]}});
        py::list out;
        for (size_t i = 0; i < ms.size(); ++i)
          out.append(to_array(o.get(ys[i], size_t(n) * ms[i]->rows), n, ms[i]->rows));
        return out;
      }, py::arg("x"), py::arg("names"), "[x W^T for each named W], in one call sharing x")
      .def("forward", [](BackendOps& o, int n, py::object attn, py::object gdn, py::handle parents_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        // attn: {layer a: (q, k, v)}, gdn: {layer g: (qkv, g, beta)} for this forward's rows
        const ModelDims& d = o.dims();
        const std::vector<int> parents = as_ints(parents_obj, "parents");
        const int P = o.be().length();
        SW_CHECK(n > 0 && n <= Engine::kMaxVerifyNodes, "n = ", n);
        SW_CHECK(int(py::len(attn)) == d.n_attn() && int(py::len(gdn)) == d.n_layers() - d.n_attn(),
                 "a forward runs every layer: ", d.n_attn(), " attention and ",
                 d.n_layers() - d.n_attn(), " GDN layers");
        SW_CHECK(parents.empty() || int(parents.size()) == n, "parents has ", parents.size(),
                 " entries for ", n, " rows");
        // a prefill chunk (parents empty: a chain committed as it goes) or a tree verified
        // against the committed state
        const BatchLayout lay = parents.empty() ? prefill_layout(P, n) : tree_layout(P, parents);
        int deepest = 0;
        for (int p : lay.pos) deepest = std::max(deepest, p + 1);
        o.be().reserve(deepest);
        o.be().begin_forward();
        const int Hq = d.n_heads, Hkv = d.n_kv_heads, D = d.head_dim, C = d.conv_dim();
        py::dict attn_out, gdn_out;
        o.tape_parents.clear();
        for (auto item : py::dict(attn)) {
          const int a = item.first.cast<int>();
          SW_CHECK(a >= 0 && a < d.n_attn(), "attention layer ", a, " out of range");
          py::tuple qkv = item.second.cast<py::tuple>();
          F32 q = as_f32(qkv[0], "q", {n, Hq, D}), k = as_f32(qkv[1], "k", {n, Hkv, D}),
              v = as_f32(qkv[2], "v", {n, Hkv, D});
          o.be().upload(o.be().kv_rows(a, n, false), k.data(), k.size());
          o.be().upload(o.be().kv_rows(a, n, true), v.data(), v.size());
          Act qa = o.put(B::kQ, q.data(), q.size()), att = o.be().scratch(B::kAtt, q.size());
          o.be().attend(a, qa, lay, att);
          attn_out[py::int_(a)] = shaped(o.get(att, q.size()), q);
        }
        for (auto item : py::dict(gdn)) {
          const int g = item.first.cast<int>();
          SW_CHECK(g >= 0 && g < d.n_layers() - d.n_attn(), "GDN layer ", g, " out of range");
          py::tuple in = item.second.cast<py::tuple>();
          F32 x = as_f32(in[0], "qkv", {n, C}), dec = as_f32(in[1], "g", {n, d.hv}),
              beta = as_f32(in[2], "beta", {n, d.hv});
          Act xa = o.put(B::kQKV, x.data(), x.size()), da = o.put(B::kDecay, dec.data(), dec.size());
          Act ba = o.put(B::kBeta, beta.data(), beta.size());
          const size_t no = size_t(n) * d.hv * d.dv;
          Act oa = o.be().scratch(B::kO, no);
          o.be().gdn(g, xa, da, ba, lay, oa);
          gdn_out[py::int_(g)] = to_array(o.get(oa, no), n, py::ssize_t(d.hv) * d.dv);
        }
        if (lay.prefill)
          o.be().set_length(P + n);
        else
          o.tape_parents = parents;
        return py::make_tuple(attn_out, gdn_out);
      }, py::arg("n"), py::arg("attn"), py::arg("gdn"), py::arg("parents") = py::tuple(),
         "One forward's stateful ops over one layout: per attention layer a, q/k/v [n, H, D] "
         "-> attend's output; per GDN layer g, (qkv [n, C], g, beta [n, hv]) -> out [n, hv * dv]; "
         "returns ({a: out}, {g: out}). Every layer of the model takes part. parents empty: a prefill chunk, committed as it goes; else a tree "
         "verified against the committed state (commit(path) next).")
      .def("commit", [](BackendOps& o, py::handle path_obj) {
        Exclusive::Use use(o.exclusive, kOpsBusy, kOpsReentered);
        const std::vector<int> path = as_ints(path_obj, "path");
        SW_CHECK(!o.tape_parents.empty(), "commit without a preceding tree forward");
        check_path(o.tape_parents.data(), int(o.tape_parents.size()), path);
        const int P = o.be().length();
        o.be().reserve(P + int(path.size()));
        o.be().commit(P, path);
        o.tape_parents.clear();
      }, py::arg("path"), "Commit a path of the last tree forward.");
}
