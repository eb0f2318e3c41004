#include "model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "kernels/kernels.h"

namespace sapwood {

int ModelDims::n_attn() const { return int(std::count(is_attn.begin(), is_attn.end(), true)); }

size_t ModelWeights::bytes() const {
  size_t b = embed.bytes() + lm_head.bytes() + final_norm.size() * 4;
  for (const auto& l : layers) {
    for (const QMatrix* m : l.matrices()) b += m->bytes();
    b += 4 * (l.in_norm.size() + l.post_norm.size() + l.conv_w.size() + l.dt_bias.size() +
              l.neg_exp_a.size() + l.gnorm.size() + l.q_norm.size() + l.k_norm.size());
  }
  return b;
}

long long ModelWeights::macs_per_token() const {
  long long m = (long long)head().rows * head().cols;
  for (const auto& l : layers)
    for (const QMatrix* w : l.matrices()) m += (long long)w->rows * w->cols;
  return m;
}

namespace {

const Tensor& get(const TensorMap& t, const std::string& name, std::vector<int64_t> shape) {
  auto it = t.find(name);
  SW_CHECK(it != t.end(), "missing weight tensor '", name, "'");
  SW_CHECK(it->second.shape == shape, "weight '", name, "' has the wrong shape");
  return it->second;
}

size_t numel(const Tensor& x) {
  size_t n = 1;
  for (auto s : x.shape) n *= size_t(s);
  return n;
}

std::vector<float> vec(const Tensor& x) { return std::vector<float>(x.data, x.data + numel(x)); }

std::vector<float> one_plus(const Tensor& x) {
  std::vector<float> v = vec(x);
  for (float& f : v) f += 1.0f;
  return v;
}

void check_finite(const Tensor& x, const std::string& name) {
  const size_t n = numel(x);
  for (size_t i = 0; i < n; ++i)
    SW_CHECK(std::isfinite(x.data[i]), "weight '", name, "' has a non-finite value at flat index ", i);
}

QMatrix qmat(const TensorMap& t, const std::string& name, int rows, int cols, WFormat f) {
  const Tensor& x = get(t, name, {rows, cols});
  check_finite(x, name);
  QMatrix m;
  m.quantize(x.data, rows, cols, f);
  return m;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Rotate-half RoPE on the first rot dims of each head, by the row's (cos, sin) pairs (rope_cs_).
void rope(float* x, int heads, int head_dim, int rot, const float* cs) {
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const float c = cs[2 * i], s = cs[2 * i + 1];
    for (int h = 0; h < heads; ++h) {
      float* xh = x + size_t(h) * head_dim;
      const float a = xh[i], b = xh[i + half];
      xh[i] = a * c - b * s;
      xh[i + half] = b * c + a * s;
    }
  }
}

}  // namespace

ModelWeights load_weights(const ModelDims& d, const TensorMap& t, WFormat f) {
  ModelWeights w;
  const int H = d.hidden, D = d.head_dim, C = d.conv_dim();
  w.embed = qmat(t, "model.embed_tokens.weight", d.vocab, H, f);
  if (!d.tied) w.lm_head = qmat(t, "lm_head.weight", d.vocab, H, f);
  w.final_norm = one_plus(get(t, "model.norm.weight", {H}));
  for (int i = 0; i < d.n_layers(); ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights L;
    L.in_norm = one_plus(get(t, p + "input_layernorm.weight", {H}));
    L.post_norm = one_plus(get(t, p + "post_attention_layernorm.weight", {H}));
    L.gate = qmat(t, p + "mlp.gate_proj.weight", d.inter, H, f);
    L.up = qmat(t, p + "mlp.up_proj.weight", d.inter, H, f);
    L.down = qmat(t, p + "mlp.down_proj.weight", H, d.inter, f);
    if (d.is_attn[i]) {
      const std::string a = p + "self_attn.";
      L.q = qmat(t, a + "q_proj.weight", 2 * d.n_heads * D, H, f);
      L.k = qmat(t, a + "k_proj.weight", d.n_kv_heads * D, H, f);
      L.v = qmat(t, a + "v_proj.weight", d.n_kv_heads * D, H, f);
      L.o = qmat(t, a + "o_proj.weight", H, d.n_heads * D, f);
      L.q_norm = one_plus(get(t, a + "q_norm.weight", {D}));
      L.k_norm = one_plus(get(t, a + "k_norm.weight", {D}));
    } else {
      const std::string a = p + "linear_attn.";
      L.qkv = qmat(t, a + "in_proj_qkv.weight", C, H, f);
      L.z = qmat(t, a + "in_proj_z.weight", d.hv * d.dv, H, f);
      L.out = qmat(t, a + "out_proj.weight", H, d.hv * d.dv, f);
      const Tensor& b = get(t, a + "in_proj_b.weight", {d.hv, H});
      const Tensor& aa = get(t, a + "in_proj_a.weight", {d.hv, H});
      std::vector<float> ba(vec(b));
      ba.insert(ba.end(), aa.data, aa.data + numel(aa));
      L.ba.quantize(ba.data(), 2 * d.hv, H, WFormat::F32);
      L.conv_w = vec(get(t, a + "conv1d.weight", {C, 1, d.conv_k}));
      L.dt_bias = vec(get(t, a + "dt_bias", {d.hv}));
      L.neg_exp_a = vec(get(t, a + "A_log", {d.hv}));
      for (float& x : L.neg_exp_a) x = -std::exp(x);
      L.gnorm = vec(get(t, a + "norm.weight", {d.dv}));
    }
    w.layers.push_back(std::move(L));
  }
  return w;
}

void Forward::mm(const float* x, int n,
                 std::initializer_list<std::pair<const QMatrix*, float*>> outs) {
  // One quantization of x and one parallel region for every matrix that reads it (qkv|z,
  // gate|up, q|k|v): one hand-off and one tail instead of one per matrix. Bundled target,
  // medians of 4 alternated processes: one-token verify 390 -> 360 us, 9 nodes 1104 -> 1070;
  // realistic 0.66B decode step 26.2 -> 25.4 ms.
  SW_CHECK(outs.size() >= 1 && outs.size() <= size_t(kMaxMatmuls), "1 to ", kMaxMatmuls,
           " matrices a region, got ", outs.size());
  const QMatrix& w = *outs.begin()->first;
  if (w.fmt == WFormat::Q8 || w.fmt == WFormat::Q4) acts_.quantize(x, n, w.cols, w.cols_pad);
  MatmulProblem pbs[kMaxMatmuls];
  int count = 0;
  for (const auto& [wi, y] : outs) pbs[count++] = MatmulProblem{wi, x, &acts_, n, y};
  kernels().matmul(pbs, count, threads_);
}

void Forward::gdn_mixer(int l, GDNLayer& g, const float* h, const BatchLayout& lay, float* out) {
  const LayerWeights& L = w_.layers[l];
  const int n = lay.n, C = d_.conv_dim(), hv = d_.hv, dv = d_.dv, V = hv * dv;
  float *qkv = buf(kQKV, size_t(n) * C), *z = buf(kZ, size_t(n) * V);
  float* ba = buf(kBA, size_t(n) * 2 * hv);
  mm(h, n, {{&L.qkv, qkv}, {&L.ba, ba}, {&L.z, z}});  // ba: f32, always
  float *beta = buf(kBeta, size_t(n) * hv), *gdec = buf(kDecay, size_t(n) * hv);
  float* o = buf(kO, size_t(n) * V);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < hv; ++j) {
      beta[size_t(i) * hv + j] = sigmoid(ba[size_t(i) * 2 * hv + j]);
      gdec[size_t(i) * hv + j] =
          L.neg_exp_a[j] * softplus(ba[size_t(i) * 2 * hv + hv + j] + L.dt_bias[j]);
    }
  if (lay.prefill)
    g.prefill(qkv, gdec, beta, n, o, threads_);
  else
    g.verify(qkv, gdec, beta, lay.parents.data(), n, o, threads_);
  // Gated RMSNorm per value head: w * (o * rsqrt(mean(o^2) + eps)) * silu(z) (plain w).
  // (gnorm * (o * inv)) * silu(z) == silu(z) * ((o * inv) * gnorm): products commute, bits
  // unchanged; silu_mul writes the gate's product over the normed o
  kernels().rms_norm(o, L.gnorm.data(), n * hv, dv, d_.eps, o);
  kernels().silu_mul(z, o, o, size_t(n) * V);
  mm(o, n, {{&L.out, out}});
}

void Forward::attn_mixer(int l, int a, const float* h, const BatchLayout& lay, KVSequence& seq,
                         KVTape& tape, float* out) {
  const LayerWeights& L = w_.layers[l];
  const int n = lay.n, D = d_.head_dim, Hq = d_.n_heads, Hkv = d_.n_kv_heads;
  const size_t nq = size_t(n) * Hq * D;
  float *qg = buf(kQG, 2 * nq), *q = buf(kQ, nq), *gate = buf(kAttGate, nq);
  tape.k.resize(size_t(n) * Hkv * D);
  tape.v.resize(size_t(n) * Hkv * D);
  mm(h, n, {{&L.q, qg}, {&L.k, tape.k.data()}, {&L.v, tape.v.data()}});
  for (int i = 0; i < n; ++i)
    for (int hh = 0; hh < Hq; ++hh) {  // per head [q | gate]
      const float* src = qg + (size_t(i) * Hq + hh) * 2 * D;
      std::copy(src, src + D, q + (size_t(i) * Hq + hh) * D);
      std::copy(src + D, src + 2 * D, gate + (size_t(i) * Hq + hh) * D);
    }
  // every head of every row in one call each, so that their norms' chains run side by side
  // (a call per head ran one 64-long fmaf chain at a time)
  kernels().rms_norm(q, L.q_norm.data(), n * Hq, D, d_.eps, q);
  kernels().rms_norm(tape.k.data(), L.k_norm.data(), n * Hkv, D, d_.eps, tape.k.data());
  const int half = d_.rotary_dim / 2;
  for (int i = 0; i < n; ++i) {
    const float* cs = rope_cs_.data() + size_t(i) * 2 * half;
    rope(q + size_t(i) * Hq * D, Hq, D, d_.rotary_dim, cs);
    rope(tape.k.data() + size_t(i) * Hkv * D, Hkv, D, d_.rotary_dim, cs);
  }
  float *kt = nullptr, *vt = nullptr;  // the tree rows' keys and values (verify only)
  if (lay.prefill) {
    // The rows are positions hist_len - n .. hist_len - 1, committed as they go: their keys
    // and values are written to pages first and read back from there like any history.
    const int start = lay.hist_len - n;
    for (int i = 0; i < n; ++i)
      seq.write(start + i, a, tape.k.data() + size_t(i) * Hkv * D, tape.v.data() + size_t(i) * Hkv * D);
  } else {
    // Tree rows see each other's keys as the cache will hold them: int8-roundtripped.
    const KVDtype dt = seq.pool().dtype();
    kt = buf(kKT, tape.k.size());
    vt = buf(kVT, tape.v.size());
    for (size_t r = 0; r < size_t(n) * Hkv; ++r) {
      kv_roundtrip(tape.k.data() + r * D, D, dt, kt + r * D);
      kv_roundtrip(tape.v.data() + r * D, D, dt, vt + r * D);
    }
  }
  float* att = buf(kAtt, nq);
  AttnProblem pb{n, Hq, Hkv, D, q, att, lay.row_len.data(), lay.hist_len, &seq,
                 a, kt, vt, lay.anc.data(), lay.anc_stride, kAttnSplit,
                 1.0f / std::sqrt(float(D))};
  kernels().tree_attention(pb, threads_);
  kernels().sigmoid_mul(gate, att, att, nq);
  mm(att, n, {{&L.o, out}});
}

}  // namespace sapwood

namespace sapwood {

void Forward::run(const int* tokens, const BatchLayout& lay, KVSequence& seq,
                  std::vector<GDNLayer>& gdn, std::vector<KVTape>& tape, int logit_from,
                  std::vector<float>* logits) {
  const int n = lay.n, H = d_.hidden, I = d_.inter;
  const size_t nh = size_t(n) * H, ni = size_t(n) * I;
  float *x = buf(kX, nh), *h = buf(kH, nh), *mix = buf(kMix, nh);
  for (int i = 0; i < n; ++i) w_.embed.dequant_row(tokens[i], x + size_t(i) * H);
  float *g = buf(kGate, ni), *u = buf(kUp, ni);
  // RoPE's (cos, sin) per row and frequency, once a forward rather than per head set and
  // attention layer (in double from the position, as before: the same bits). 36 angle sets of
  // libm pow/cos/sin in a 9-node verify of the bundled target became 9.
  const int half = d_.rotary_dim / 2;
  rope_cs_.resize(size_t(n) * 2 * half);
  for (int f = 0; d_.n_attn() > 0 && f < half; ++f) {
    const double inv = 1.0 / std::pow(double(d_.rope_theta), double(2 * f) / double(d_.rotary_dim));
    for (int i = 0; i < n; ++i) {
      const double ang = double(lay.pos[i]) * inv;
      rope_cs_[(size_t(i) * half + f) * 2] = float(std::cos(ang));
      rope_cs_[(size_t(i) * half + f) * 2 + 1] = float(std::sin(ang));
    }
  }
  int a = 0, gi = 0;
  for (int l = 0; l < d_.n_layers(); ++l) {
    const LayerWeights& L = w_.layers[l];
    kernels().rms_norm(x, L.in_norm.data(), n, H, d_.eps, h);
    if (d_.is_attn[l]) {
      attn_mixer(l, a, h, lay, seq, tape[a], mix);
      ++a;
    } else {
      gdn_mixer(l, gdn[gi++], h, lay, mix);
    }
    for (size_t i = 0; i < nh; ++i) x[i] += mix[i];
    kernels().rms_norm(x, L.post_norm.data(), n, H, d_.eps, h);
    mm(h, n, {{&L.gate, g}, {&L.up, u}});
    kernels().silu_mul(g, u, g, ni);
    mm(g, n, {{&L.down, mix}});
    for (size_t i = 0; i < nh; ++i) x[i] += mix[i];
  }
  const int m = n - logit_from;
  kernels().rms_norm(x + size_t(logit_from) * H, w_.final_norm.data(), m, H, d_.eps, h);
  const size_t at = logits->size();
  logits->resize(at + size_t(m) * d_.vocab);
  mm(h, m, {{&w_.head(), logits->data() + at}});
}

}  // namespace sapwood
