#include "model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "backend.h"
#include "tree.h"

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

std::vector<float> one_plus(std::vector<float> v) {
  for (float& f : v) f += 1.0f;
  return v;
}

}  // namespace

BatchLayout prefill_layout(int P, int n) {
  BatchLayout lay;
  lay.n = n;
  lay.prefill = true;
  lay.hist_len = P + n;
  for (int i = 0; i < n; ++i) lay.pos.push_back(P + i), lay.row_len.push_back(P + i + 1);
  return lay;
}

BatchLayout tree_layout(int P, const std::vector<int>& parents) {
  const int n = int(parents.size());
  check_parents(parents.data(), n);
  BatchLayout lay;
  lay.n = n;
  lay.parents = parents;
  lay.hist_len = P;
  lay.anc = ancestor_table(parents.data(), n, &lay.anc_stride);
  for (int d : tree_depths(parents.data(), n)) lay.pos.push_back(P + d), lay.row_len.push_back(P + d + 1);
  return lay;
}

std::vector<float> load_norm(WeightLoader& t, const std::string& name, int dim) {
  return one_plus(t.vector(name, {dim}));
}

LayerWeights load_layer(const ModelDims& d, WeightLoader& t, const std::string& p, bool attn,
                        WFormat f) {
  const int H = d.hidden, D = d.head_dim, C = d.conv_dim();
  LayerWeights L;
  L.in_norm = load_norm(t, p + "input_layernorm.weight", H);
  L.post_norm = load_norm(t, p + "post_attention_layernorm.weight", H);
  L.gate = t.matrix(p + "mlp.gate_proj.weight", d.inter, H, f);
  L.up = t.matrix(p + "mlp.up_proj.weight", d.inter, H, f);
  L.down = t.matrix(p + "mlp.down_proj.weight", H, d.inter, f);
  if (attn) {
    const std::string a = p + "self_attn.";
    L.q = t.matrix(a + "q_proj.weight", 2 * d.n_heads * D, H, f);
    L.k = t.matrix(a + "k_proj.weight", d.n_kv_heads * D, H, f);
    L.v = t.matrix(a + "v_proj.weight", d.n_kv_heads * D, H, f);
    L.o = t.matrix(a + "o_proj.weight", H, d.n_heads * D, f);
    L.q_norm = load_norm(t, a + "q_norm.weight", D);
    L.k_norm = load_norm(t, a + "k_norm.weight", D);
  } else {
    const std::string a = p + "linear_attn.";
    L.qkv = t.matrix(a + "in_proj_qkv.weight", C, H, f);
    L.z = t.matrix(a + "in_proj_z.weight", d.hv * d.dv, H, f);
    L.out = t.matrix(a + "out_proj.weight", H, d.hv * d.dv, f);
    // in_proj_b rows, then in_proj_a rows: one small f32 matrix
    const std::vector<float> b = t.vector(a + "in_proj_b.weight", {d.hv, H});
    const std::vector<float> aa = t.vector(a + "in_proj_a.weight", {d.hv, H});
    L.ba.init(2 * d.hv, H, WFormat::F32);
    for (int r = 0; r < d.hv; ++r) {
      L.ba.set_row(r, &b[size_t(r) * H]);
      L.ba.set_row(d.hv + r, &aa[size_t(r) * H]);
    }
    L.conv_w = t.vector(a + "conv1d.weight", {C, 1, d.conv_k});
    L.dt_bias = t.vector(a + "dt_bias", {d.hv});
    L.neg_exp_a = t.vector(a + "A_log", {d.hv});
    for (float& x : L.neg_exp_a) x = -std::exp(x);
    L.gnorm = t.vector(a + "norm.weight", {d.dv});
  }
  return L;
}

ModelWeights load_weights(const ModelDims& d, WeightLoader& t, WFormat f) {
  ModelWeights w;
  const int H = d.hidden;
  w.embed = t.matrix("model.embed_tokens.weight", d.vocab, H, f);
  if (!d.tied) w.lm_head = t.matrix("lm_head.weight", d.vocab, H, f);
  w.final_norm = load_norm(t, "model.norm.weight", H);
  for (int i = 0; i < d.n_layers(); ++i)
    w.layers.push_back(load_layer(d, t, "model.layers." + std::to_string(i) + ".", d.is_attn[i], f));
  return w;
}

void Forward::gdn_mixer(Backend& be, int l, int gi, Act h, const Rows& r, Act out) {
  const LayerWeights& L = w_.layers[l];
  const int n = r.n, C = d_.conv_dim(), hv = d_.hv, dv = d_.dv, V = hv * dv;
  Act qkv = be.scratch(kQKV, size_t(n) * C), z = be.scratch(kZ, size_t(n) * V);
  Act ba = be.scratch(kBA, size_t(n) * 2 * hv);
  be.matmul(h, n, {{&L.qkv, qkv}, {&L.ba, ba}, {&L.z, z}});  // ba: f32, always
  Act beta = be.scratch(kBeta, size_t(n) * hv), gdec = be.scratch(kDecay, size_t(n) * hv);
  be.gdn_gates(ba, n, hv, L.neg_exp_a, L.dt_bias, beta, gdec);
  Act o = be.scratch(kO, size_t(n) * V);
  if (r.parts.size() == 1) {
    be.gdn(gi, qkv, gdec, beta, *r.parts[0].lay, o);
  } else {
    size_t r0 = 0;
    for (const SeqRows& p : r.parts) {
      p.be->gdn(gi, qkv + r0 * C, gdec + r0 * hv, beta + r0 * hv, *p.lay, o + r0 * V);
      r0 += size_t(p.lay->n);
    }
  }
  // Gated RMSNorm per value head: w * (o * rsqrt(mean(o^2) + eps)) * silu(z) (plain w).
  // (gnorm * (o * inv)) * silu(z) == silu(z) * ((o * inv) * gnorm): products commute, bits
  // unchanged; silu_mul writes the gate's product over the normed o
  be.rms_norm(o, L.gnorm, n * hv, dv, d_.eps, o);
  be.silu_mul(z, o, o, size_t(n) * V);
  be.matmul(o, n, {{&L.out, out}});
}

void Forward::attn_mixer(Backend& be, int l, int a, Act h, const Rows& r, Act out) {
  const LayerWeights& L = w_.layers[l];
  const int n = r.n, D = d_.head_dim, Hq = d_.n_heads, Hkv = d_.n_kv_heads;
  const size_t nq = size_t(n) * Hq * D;
  Act qg = be.scratch(kQG, 2 * nq), q = be.scratch(kQ, nq), gate = be.scratch(kAttGate, nq);
  // one sequence: its K/V rows straight into its own rows; a forest's into shared scratch,
  // copied to each part's own rows after norm and rotary
  const bool one = r.parts.size() == 1;
  const size_t kv = size_t(Hkv) * D;
  Act k = one ? be.kv_rows(a, n, false) : be.scratch(kForestK, n * kv);
  Act v = one ? be.kv_rows(a, n, true) : be.scratch(kForestV, n * kv);
  be.matmul(h, n, {{&L.q, qg}, {&L.k, k}, {&L.v, v}});
  be.split_q_gate(qg, n, Hq, D, q, gate);
  // every head of every row in one call each, so that their norms' chains run side by side
  be.rms_norm(q, L.q_norm, n * Hq, D, d_.eps, q);
  be.rms_norm(k, L.k_norm, n * Hkv, D, d_.eps, k);
  Act cs = be.scratch(kRope, rope_cs_.size());
  be.rope(q, n, Hq, D, d_.rotary_dim, cs);
  be.rope(k, n, Hkv, D, d_.rotary_dim, cs);
  Act att = be.scratch(kAtt, nq);
  if (one) {
    be.attend(a, q, *r.parts[0].lay, att);
  } else {
    size_t r0 = 0;
    for (const SeqRows& p : r.parts) {
      const int m = p.lay->n;
      be.copy(p.be->kv_rows(a, m, false), k + r0 * kv, m * kv);
      be.copy(p.be->kv_rows(a, m, true), v + r0 * kv, m * kv);
      p.be->attend(a, q + r0 * Hq * D, *p.lay, att + r0 * Hq * D);
      r0 += size_t(m);
    }
  }
  be.sigmoid_mul(gate, att, att, nq);
  be.matmul(att, n, {{&L.o, out}});
}

}  // namespace sapwood

namespace sapwood {

Act Forward::run(Backend& be, const int* tokens, const BatchLayout& lay, int logit_from,
                 std::vector<float>* logits, std::vector<float>* hidden) {
  const std::vector<SeqRows> one{{&be, &lay}};
  return forward(be, tokens, Rows{lay.n, lay.pos, one}, logit_from, logits, hidden);
}

void Forward::run_forest(Backend& ops, const std::vector<SeqRows>& parts, const int* tokens,
                         std::vector<float>* logits, std::vector<float>* hidden) {
  SW_CHECK(!parts.empty(), "a forest of no sequences");
  std::vector<int> pos;
  for (const SeqRows& p : parts) {
    SW_CHECK(!p.lay->prefill, "a forest forward verifies trees; prefill runs alone");
    pos.insert(pos.end(), p.lay->pos.begin(), p.lay->pos.end());
  }
  forward(ops, tokens, Rows{int(pos.size()), pos, parts}, 0, logits, hidden);
}

Act Forward::forward(Backend& be, const int* tokens, const Rows& r, int logit_from,
                     std::vector<float>* logits, std::vector<float>* hidden) {
  const int n = r.n, H = d_.hidden;
  const size_t nh = size_t(n) * H;
  Act x = be.scratch(kX, nh);
  be.embed(w_.embed, tokens, n, x);
  layers(be, x, r);
  Act h = be.scratch(kH, nh);
  const int m = n - logit_from;
  be.rms_norm(x + size_t(logit_from) * H, w_.final_norm, m, H, d_.eps, h);
  if (hidden) {  // the rows before logit_from are normed on their own: h's rows stay as they were
    hidden->resize(nh);
    if (logit_from > 0) {
      Act hx = be.scratch(kMix, size_t(logit_from) * H);
      be.rms_norm(x, w_.final_norm, logit_from, H, d_.eps, hx);
      be.download(hx, size_t(logit_from) * H, hidden->data());
    }
    be.download(h, size_t(m) * H, hidden->data() + size_t(logit_from) * H);
  }
  Act y = be.scratch(kLogits, size_t(m) * d_.vocab);
  be.matmul(h, m, {{&w_.head(), y}});
  if (logits) {
    const size_t at = logits->size();
    logits->resize(at + size_t(m) * d_.vocab);
    be.download(y, size_t(m) * d_.vocab, logits->data() + at);
  }
  return y;
}

void Forward::run_layers(Backend& be, Act x, const BatchLayout& lay) {
  const std::vector<SeqRows> one{{&be, &lay}};
  layers(be, x, Rows{lay.n, lay.pos, one});
}

void Forward::layers(Backend& be, Act x, const Rows& r) {
  const int n = r.n, H = d_.hidden, I = d_.inter;
  const size_t nh = size_t(n) * H, ni = size_t(n) * I;
  Act h = be.scratch(kH, nh), mix = be.scratch(kMix, nh);
  Act g = be.scratch(kGate, ni), u = be.scratch(kUp, ni);
  for (const SeqRows& p : r.parts) p.be->begin_forward();
  // RoPE's (cos, sin) per row and frequency, once a forward rather than per head set and
  // attention layer (in double from the position, as before: the same bits).
  const int half = d_.rotary_dim / 2;
  rope_cs_.resize(size_t(n) * 2 * half);
  for (int f = 0; d_.n_attn() > 0 && f < half; ++f) {
    const double inv = 1.0 / std::pow(double(d_.rope_theta), double(2 * f) / double(d_.rotary_dim));
    for (int i = 0; i < n; ++i) {
      const double ang = double(r.pos[i]) * inv;
      rope_cs_[(size_t(i) * half + f) * 2] = float(std::cos(ang));
      rope_cs_[(size_t(i) * half + f) * 2 + 1] = float(std::sin(ang));
    }
  }
  if (d_.n_attn() > 0 && half > 0) be.upload(be.scratch(kRope, rope_cs_.size()), rope_cs_.data(), rope_cs_.size());
  int a = 0, gi = 0;
  for (int l = 0; l < d_.n_layers(); ++l) {
    const LayerWeights& L = w_.layers[l];
    be.rms_norm(x, L.in_norm, n, H, d_.eps, h);
    if (d_.is_attn[l])
      attn_mixer(be, l, a++, h, r, mix);
    else
      gdn_mixer(be, l, gi++, h, r, mix);
    be.add(x, mix, nh);
    be.rms_norm(x, L.post_norm, n, H, d_.eps, h);
    be.matmul(h, n, {{&L.gate, g}, {&L.up, u}});
    be.silu_mul(g, u, g, ni);
    be.matmul(g, n, {{&L.down, mix}});
    be.add(x, mix, nh);
  }
}

}  // namespace sapwood
