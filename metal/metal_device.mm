// The real Metal device: sapwood::gpu::Device (csrc/gpu/device.h) on an Apple GPU. Objective-C++
// with ARC (-fobjc-arc), macOS only; the emulated twin is emu/metal_device.cpp.
//
// - Library: sapwood.metallib ($SAPWOOD_METALLIB, else next to the _core module, else the build
//   tree's copy), every metal/*.metal compiled offline with -fno-fast-math.
// - pipeline(name): MTLFunction by name -> MTLComputePipelineState, cached for the device's life.
// - Buffers: MTLResourceStorageModeShared (unified memory), so `host` is the buffer's contents.
// - One MTLCommandBuffer and one compute encoder per forward: dispatch() encodes (arguments by
//   index: a buffer + offset with setBuffer, a constant block with setBytes, copied at encoding
//   time; [[threadgroup(i)]] sized by setThreadgroupMemoryLength), wait() ends the encoder,
//   commits, waits, and reports a failed command buffer. The encoder is serial (the default
//   dispatch type), so each dispatch sees the writes of the ones before it.
//
// Written against Apple's documented API; never compiled on the machines that wrote it (see
// metal/README.md, "What only a Mac can tell").
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "metal_device.h"
#include "sw_common.h"

namespace {

std::string metallib_path() {
  if (const char* env = std::getenv("SAPWOOD_METALLIB")) return env;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&metallib_path), &info) && info.dli_fname) {
    std::string dir(info.dli_fname);
    dir = dir.substr(0, dir.find_last_of('/') + 1) + "sapwood.metallib";
    if (FILE* f = std::fopen(dir.c_str(), "rb")) {
      std::fclose(f);
      return dir;
    }
  }
#ifdef SAPWOOD_METALLIB_PATH
  return SAPWOOD_METALLIB_PATH;
#else
  return "sapwood.metallib";
#endif
}

std::string describe(NSError* err) {
  return err ? std::string(err.localizedDescription.UTF8String) : std::string("unknown error");
}

class MetalDevice final : public sapwood::gpu::Device {
 public:
  MetalDevice() {
    dev_ = MTLCreateSystemDefaultDevice();
    if (!dev_) throw std::runtime_error("metal: no Metal GPU on this machine");
    queue_ = [dev_ newCommandQueue];
    const std::string path = metallib_path();
    NSError* err = nil;
    lib_ = [dev_ newLibraryWithURL:[NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()]]
                             error:&err];
    if (!lib_) throw std::runtime_error("metal: cannot load " + path + ": " + describe(err) +
                                        " (set SAPWOOD_METALLIB or reinstall with `pip install .`)");
  }
  ~MetalDevice() override {
    if (enc_) [enc_ endEncoding];
    if (cb_) {
      [cb_ commit];
      [cb_ waitUntilCompleted];
    }
  }

  std::string name() const override { return "metal"; }

  sapwood::gpu::Buffer alloc(size_t bytes) override {
    id<MTLBuffer> b = [dev_ newBufferWithLength:(bytes ? bytes : 16) options:MTLResourceStorageModeShared];
    if (!b) throw std::runtime_error("metal: cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(b.contents, 0, b.length);
    sapwood::gpu::Buffer out;
    out.host = b.contents;
    out.bytes = bytes;
    out.handle = (__bridge_retained void*)b;  // released in release()
    return out;
  }
  void release(sapwood::gpu::Buffer& b) override {
    if (b.handle) {
      id<MTLBuffer> owned = (__bridge_transfer id<MTLBuffer>)b.handle;
      owned = nil;
    }
    b = sapwood::gpu::Buffer{};
  }

  const void* pipeline(const std::string& fn_name) override {
    auto it = pipes_.find(fn_name);
    if (it != pipes_.end()) return (__bridge const void*)it->second;
    id<MTLFunction> f = [lib_ newFunctionWithName:[NSString stringWithUTF8String:fn_name.c_str()]];
    if (!f) throw std::runtime_error("metal: no kernel named '" + fn_name + "' in sapwood.metallib");
    NSError* err = nil;
    id<MTLComputePipelineState> p = [dev_ newComputePipelineStateWithFunction:f error:&err];
    if (!p) throw std::runtime_error(fn_name + ": pipeline creation failed: " + describe(err));
    if (p.threadExecutionWidth != SW_SIMD)  // every canonical order assumes 32-wide simdgroups
      throw std::runtime_error(fn_name + ": simdgroup width " + std::to_string(p.threadExecutionWidth) + ", not 32");
    pipes_[fn_name] = p;
    names_[(__bridge const void*)p] = fn_name;
    return (__bridge const void*)p;
  }

  void dispatch(const void* pipeline, const std::vector<sapwood::gpu::Arg>& args,
                const sapwood::gpu::Launch& l) override {
    id<MTLComputePipelineState> p = (__bridge id<MTLComputePipelineState>)pipeline;
    const std::string& nm = names_.at(pipeline);
    if (l.threads <= 0 || l.threads % SW_SIMD || l.threads > int(p.maxTotalThreadsPerThreadgroup))
      throw std::runtime_error(nm + ": " + std::to_string(l.threads) + " threads per threadgroup; this pipeline takes "
                               "multiples of 32 up to " + std::to_string(p.maxTotalThreadsPerThreadgroup));
    if (!l.groups[0] || !l.groups[1] || !l.groups[2]) return;  // an empty grid runs nothing
    if (!cb_) {
      cb_ = [queue_ commandBuffer];
      enc_ = [cb_ computeCommandEncoder];
    }
    [enc_ setComputePipelineState:p];
    for (size_t i = 0; i < args.size(); ++i) {
      const sapwood::gpu::Arg& a = args[i];
      if (a.buf) {
        if (a.offset > a.buf->bytes) throw std::runtime_error(nm + ": buffer(" + std::to_string(i) + ") offset past its end");
        [enc_ setBuffer:(__bridge id<MTLBuffer>)a.buf->handle offset:a.offset atIndex:i];
      } else if (a.bytes && a.size <= 4096) {  // setBytes: small blocks only
        [enc_ setBytes:a.bytes length:a.size atIndex:i];
      } else {
        throw std::runtime_error(nm + ": buffer(" + std::to_string(i) + ") is unbound or a constant block over 4 KB");
      }
    }
    for (size_t i = 0; i < l.threadgroup_bytes.size(); ++i)
      [enc_ setThreadgroupMemoryLength:(l.threadgroup_bytes[i] + 15) / 16 * 16 atIndex:i];
    [enc_ dispatchThreadgroups:MTLSizeMake(l.groups[0], l.groups[1], l.groups[2])
         threadsPerThreadgroup:MTLSizeMake(NSUInteger(l.threads), 1, 1)];
  }

  void wait() override {
    if (!cb_) return;
    [enc_ endEncoding];
    id<MTLCommandBuffer> cb = cb_;
    cb_ = nil;
    enc_ = nil;
    [cb commit];
    [cb waitUntilCompleted];
    if (cb.status == MTLCommandBufferStatusError)
      throw std::runtime_error("metal: command buffer failed: " + describe(cb.error));
  }

  int max_threads(const void* pipeline) override {
    return int(((__bridge id<MTLComputePipelineState>)pipeline).maxTotalThreadsPerThreadgroup);
  }

 private:
  id<MTLDevice> dev_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  id<MTLLibrary> lib_ = nil;
  id<MTLCommandBuffer> cb_ = nil;
  id<MTLComputeCommandEncoder> enc_ = nil;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipes_;  // strong references (ARC)
  std::unordered_map<const void*, std::string> names_;
};

}  // namespace

namespace sapwood::gpu {

bool metal_device_present() {
  id<MTLDevice> d = MTLCreateSystemDefaultDevice();
  if (!d) return false;
  FILE* f = std::fopen(metallib_path().c_str(), "rb");
  if (f) std::fclose(f);
  return f != nullptr;
}

std::unique_ptr<Device> make_metal_device() { return std::make_unique<MetalDevice>(); }

}  // namespace sapwood::gpu
