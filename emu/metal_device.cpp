// The emulated Metal device: sapwood::gpu::Device (csrc/gpu/device.h) on host memory. Every
// `kernel void` of metal/*.metal is compiled here, unmodified, as C++ under metal_shim.hpp, and
// registered by name with a binder that passes its arguments exactly as the Metal host binds
// them: args[i] is [[buffer(i)]], Launch::threadgroup_bytes[i] sizes [[threadgroup(i)]], the
// built-ins come from the fiber runner's ThreadCtx. dispatch() runs the grid at once (the
// emulator has no queue); wait() is a sync point with nothing to wait for.
//
// Built as its own object library with the emulator's flags (-fsigned-char -ffp-contract=off
// -Wno-attributes, see CMakeLists.txt), because metal_shim.hpp defines `device`, `kernel`,
// `thread`... as empty macros: every standard header is included before it, and no other
// translation unit includes it.
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu_device.hpp"
#include "gpu/device.h"

#include "metal_shim.hpp"
// The kernels (each file's header states its canonical reduction orders).
#include "kv_quant.metal"
#include "tree_attention.metal"
#include "gdn.metal"
#include "q8_matmul.metal"
#include "matmul.metal"
#include "elementwise.metal"
#include "rows.metal"

namespace {

using swemu::ThreadCtx;
constexpr int kMaxParams = 32;

// One dispatch's resolved arguments, indexed by kernel parameter position.
struct Frame {
  const char* kinds;
  void* ptr[kMaxParams];       // b: the buffer (or constant block) address
  size_t tg_off[kMaxParams];   // t: offset into the group's threadgroup memory
};

template <class P> P arg(const Frame& f, const ThreadCtx& c, int i) {
  if constexpr (std::is_pointer_v<P>) {
    return static_cast<P>(f.kinds[i] == 't' ? static_cast<void*>(c.smem + f.tg_off[i]) : f.ptr[i]);
  } else if constexpr (std::is_reference_v<P>) {
    return *static_cast<std::remove_reference_t<P>*>(f.ptr[i]);
  } else if constexpr (std::is_same_v<P, metal::uint3>) {
    return metal::uint3(c.tg[0], c.tg[1], c.tg[2]);
  } else {
    static_assert(std::is_same_v<P, metal::uint>, "kernel parameter of an unsupported type");
    switch (f.kinds[i]) {
      case 'i': return metal::uint(c.tid);
      case 'l': return metal::uint(c.lane);
      case 's': return metal::uint(c.sg);
      default: return metal::uint(c.nsg);
    }
  }
}

// What a parameter type accepts: p pointer, r reference (a `constant T&` block), v uint3, u uint.
template <class P> constexpr char type_class() {
  return std::is_pointer_v<P> ? 'p' : std::is_reference_v<P> ? 'r' : std::is_same_v<P, metal::uint3> ? 'v' : 'u';
}
template <class P> constexpr size_t ref_size() {
  if constexpr (std::is_reference_v<P>) return sizeof(std::remove_reference_t<P>);
  else return 0;
}

using Erased = void (*)();
template <class... P, size_t... I>
void call(void (*fn)(P...), const Frame& f, const ThreadCtx& c, std::index_sequence<I...>) {
  fn(arg<P>(f, c, int(I))...);
}
template <class... P> void invoke(Erased fn, const Frame& f, const ThreadCtx& c) {
  call(reinterpret_cast<void (*)(P...)>(fn), f, c, std::index_sequence_for<P...>{});
}

struct Kernel {
  const char* name;
  const char* kinds;
  Erased fn;
  void (*run)(Erased, const Frame&, const ThreadCtx&);
  int nparams, nbuf, ntg;
  char cls[kMaxParams];
  size_t ref[kMaxParams];
};

// A registry entry, its signature checked against the parameter types (a kinds string that
// disagrees with the kernel is a build defect, reported on first use of the registry).
template <class... P> Kernel entry(const char* name, const char* kinds, void (*fn)(P...)) {
  static_assert(sizeof...(P) <= kMaxParams, "too many kernel parameters");
  Kernel k{name, kinds, reinterpret_cast<Erased>(fn), &invoke<P...>, int(sizeof...(P)), 0, 0, {}, {}};
  const char cls[] = {type_class<P>()..., 0};
  const size_t ref[] = {ref_size<P>()..., 0};
  const std::string ks(kinds);
  std::string bad = ks.size() == sizeof...(P) ? "" : "has " + std::to_string(sizeof...(P)) + " parameters";
  for (size_t i = 0; bad.empty() && i < ks.size(); ++i) {
    const char want = ks[i] == 'b' ? (cls[i] == 'r' ? 'r' : 'p') : ks[i] == 't' ? 'p' : ks[i] == 'g' ? 'v' : 'u';
    if (cls[i] != want || !std::strchr("btgilsn", ks[i])) bad = "parameter " + std::to_string(i) + " is not '" + ks[i] + "'";
    k.cls[i] = cls[i];
    k.ref[i] = ref[i];
    k.nbuf += ks[i] == 'b';
    k.ntg += ks[i] == 't';
  }
  if (!bad.empty()) throw std::logic_error(std::string("emulated Metal registry: ") + name + " " + bad);
  return k;
}

// Every kernel of metal/*.metal (a test parses the sources and compares names and signatures).
#define SW_KERNEL(name, kinds) entry(#name, kinds, &name),
const std::vector<Kernel>& registry() {
  static const std::vector<Kernel> r = {
      SW_KERNEL(kv_quantize, "bbbbbgil")
      SW_KERNEL(tree_attn_partial, "bbbbbbbbbbbbbbtgilsn")
      SW_KERNEL(tree_attn_merge, "bbbbgl")
      SW_KERNEL(gdn_conv, "bbbbbbbbgl")
      SW_KERNEL(gdn_recur, "bbbbbbbbbbbbbbtgi")
      SW_KERNEL(gdn_commit, "bbbbbbbbbbbbbbbbtgi")
      SW_KERNEL(gdn_window, "bbbbbgi")
      SW_KERNEL(q8_quantize_rows, "bbbbtgilsn")
      SW_KERNEL(q8_matmul, "bbbbbbglsn")
      SW_KERNEL(q4_matmul, "bbbbbbbglsn")
      SW_KERNEL(matmul_f32, "bbbbglsn")
      SW_KERNEL(matmul_bf16, "bbbbglsn")
      SW_KERNEL(embed_rows_f32, "bbbbgin")
      SW_KERNEL(embed_rows_bf16, "bbbbgin")
      SW_KERNEL(embed_rows_q8, "bbbbbgin")
      SW_KERNEL(embed_rows_q4, "bbbbbbgin")
      SW_KERNEL(add_inplace, "bbbgin")
      SW_KERNEL(silu_mul, "bbbbgin")
      SW_KERNEL(sigmoid_mul, "bbbbgin")
      SW_KERNEL(split_q_gate, "bbbbgin")
      SW_KERNEL(rope, "bbbgin")
      SW_KERNEL(gdn_gates, "bbbbbbgin")
      SW_KERNEL(gather_rows, "bbbbgin")
      SW_KERNEL(rms_norm, "bbbbgiln")
      SW_KERNEL(argmax_rows, "bbbttgilsn")
      SW_KERNEL(logsumexp_rows, "bbbtgilsn")
      SW_KERNEL(top_k_rows, "bbbbbttgilsn")
  };
  return r;
}
#undef SW_KERNEL

std::mutex& runner_mutex() {  // one fiber runner per process (fiber.hpp: not thread-safe)
  static std::mutex m;
  return m;
}

[[noreturn]] void fail(const Kernel& k, const std::string& what) {
  throw std::runtime_error(std::string(k.name) + ": " + what);
}

class EmulatedMetal final : public sapwood::gpu::Device {
 public:
  std::string name() const override { return "metal-emulated"; }

  sapwood::gpu::Buffer alloc(size_t bytes) override {
    const size_t n = (bytes + 63) / 64 * 64 + 64;  // never 0; room past the end for char4 reads
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::runtime_error("metal-emulated: cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, n);
    return sapwood::gpu::Buffer{p, p, bytes};
  }
  void release(sapwood::gpu::Buffer& b) override {
    std::free(b.handle);
    b = sapwood::gpu::Buffer{};
  }

  // (no parameter may be called `kernel`, `device`, `thread`...: the shim's macros are live here)
  const void* pipeline(const std::string& fn_name) override {
    for (const Kernel& k : registry())
      if (fn_name == k.name) return &k;
    throw std::runtime_error("metal-emulated: no kernel named '" + fn_name + "' in metal/*.metal");
  }

  void dispatch(const void* pipeline, const std::vector<sapwood::gpu::Arg>& args,
                const sapwood::gpu::Launch& l) override {
    const Kernel& k = *static_cast<const Kernel*>(pipeline);
    if (int(args.size()) != k.nbuf)
      fail(k, "takes " + std::to_string(k.nbuf) + " buffer arguments, got " + std::to_string(args.size()));
    if (int(l.threadgroup_bytes.size()) != k.ntg)
      fail(k, "takes " + std::to_string(k.ntg) + " threadgroup memory arguments, got " +
                  std::to_string(l.threadgroup_bytes.size()));
    if (l.threads <= 0 || l.threads % 32 || l.threads > max_threads(pipeline))
      fail(k, "threads per threadgroup must be a positive multiple of 32 up to 1024, got " + std::to_string(l.threads));
    Frame f{k.kinds, {}, {}};
    std::vector<std::vector<unsigned char>> blocks;  // constant blocks, copied at encoding time
    blocks.reserve(args.size());
    size_t smem = 0;
    for (int i = 0, b = 0, t = 0; i < k.nparams; ++i) {
      if (k.kinds[i] == 't') {
        f.tg_off[i] = smem;
        smem += (l.threadgroup_bytes[t++] + 15) / 16 * 16;  // Metal's 16-byte granule
        continue;
      }
      if (k.kinds[i] != 'b') continue;
      const sapwood::gpu::Arg& a = args[b++];
      size_t avail;
      if (a.buf) {
        if (!a.buf->host || a.offset > a.buf->bytes)
          fail(k, "buffer(" + std::to_string(b - 1) + "): offset " + std::to_string(a.offset) + " past its " +
                      std::to_string(a.buf->bytes) + " bytes");
        f.ptr[i] = static_cast<char*>(a.buf->host) + a.offset;
        avail = a.buf->bytes - a.offset;
      } else if (a.bytes) {
        blocks.emplace_back(static_cast<const unsigned char*>(a.bytes),
                            static_cast<const unsigned char*>(a.bytes) + a.size);
        blocks.back().resize(a.size + 16);  // aligned enough for ints and floats
        f.ptr[i] = blocks.back().data();
        avail = a.size;
        if (k.cls[i] == 'r' && a.size != k.ref[i])
          fail(k, "buffer(" + std::to_string(b - 1) + "): a constant block of " + std::to_string(a.size) +
                      " bytes for a parameter block of " + std::to_string(k.ref[i]));
      } else {
        fail(k, "buffer(" + std::to_string(b - 1) + ") is unbound");
      }
      if (k.cls[i] == 'r' && avail < k.ref[i])
        fail(k, "buffer(" + std::to_string(b - 1) + "): " + std::to_string(avail) + " bytes for a parameter block of " +
                    std::to_string(k.ref[i]));
    }
    if (!l.groups[0] || !l.groups[1] || !l.groups[2]) return;  // an empty grid runs nothing
    std::lock_guard<std::mutex> lock(runner_mutex());
    try {
      swemu::runner().launch(l.groups, l.threads, smem, [&](const ThreadCtx& c) { k.run(k.fn, f, c); });
    } catch (const swemu::Error& e) {
      fail(k, e.what());
    }
  }

  void wait() override {}
  int max_threads(const void*) override { return swemu::Runner::kMaxThreads; }
};

}  // namespace

namespace sapwood::gpu {

std::unique_ptr<Device> make_emulated_metal_device() {
  registry();  // a signature defect surfaces here, not in the middle of a forward
  return std::make_unique<EmulatedMetal>();
}

std::vector<std::pair<std::string, std::string>> emulated_metal_kernels() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Kernel& k : registry()) out.emplace_back(k.name, k.kinds);
  return out;
}

}  // namespace sapwood::gpu
