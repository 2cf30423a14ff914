// Issue 33's side-by-side: SGLang's HiSparse swap-in kernel (`load_cache_to_device_buffer_kernel`, from the
// sglang wheel's kernels/jit/csrc/kvcacheio/hisparse.cuh), launched unmodified through a C entry point that
// bench/peer/hisparse_peer.py calls with ctypes. Nothing of the peer is vendored: bench/peer/build.py extracts
// its headers from the wheel into .peer/ (git-ignored) and compiles this file against them at benchmark time.
//
// One instantiation per (hot buffer size, SkipIO): top-k 2,048 tokens, 256 threads (sglang's default block_size),
// MLA (one K buffer), linear host / device rows of item_bytes, token-granular top-k, no miss-plan recording,
// int64 seq_lens and req_pool_indices. SkipIO = 1 elides only the row copies (the peer's own timing probe: its
// plan alone). Returns a cudaError_t (0 = launched), or -1 for a hot size not instantiated.
#include <kvcacheio/hisparse.cuh>
#include <cuda_runtime.h>

namespace {
template <int HOT, bool SKIP>
int launch(const int32_t* top_k, int32_t* dbt, const int64_t* hcl, const int32_t* dbl, const void* host, void* dev,
           int32_t* out, const int64_t* rpi, const int64_t* seq, int16_t* lru, const int32_t* nreal, int64_t bs,
           int64_t buffer_stride0, int64_t host_stride, int64_t lru_stride0, int64_t topk_stride, int64_t out_stride,
           int64_t page_size, int64_t item_bytes, cudaStream_t stream) {
  constexpr int BLOCK = 256, TOPK = 2048;
  auto kern = sglang::load_cache_to_device_buffer_kernel<BLOCK, TOPK, HOT, true, false, 1, false, false, SKIP, int64_t, int64_t>;
  constexpr size_t smem = sglang::SmemLayout<TOPK, HOT>::BYTES;
  if (smem > 48u * 1024u) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
  }
  kern<<<(unsigned)bs, BLOCK, smem, stream>>>(top_k, dbt, hcl, dbl, host, nullptr, dev, nullptr, out, rpi, seq, lru, nreal,
      buffer_stride0, host_stride, lru_stride0, topk_stride, out_stride, page_size, item_bytes, nullptr, nullptr, nullptr, 0);
  return (int)cudaGetLastError();
}
}  // namespace

extern "C" int dhs_peer_load(int hot, int skip_io, const int32_t* top_k, int32_t* dbt, const int64_t* hcl,
                             const int32_t* dbl, const void* host, void* dev, int32_t* out, const int64_t* rpi,
                             const int64_t* seq, int16_t* lru, const int32_t* nreal, int64_t bs, int64_t buffer_stride0,
                             int64_t host_stride, int64_t lru_stride0, int64_t topk_stride, int64_t out_stride,
                             int64_t page_size, int64_t item_bytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
#define DHS_CASE(H)                                                                                                    \
  if (hot == H) return skip_io ? launch<H, true>(top_k, dbt, hcl, dbl, host, dev, out, rpi, seq, lru, nreal, bs,       \
                                                 buffer_stride0, host_stride, lru_stride0, topk_stride, out_stride,    \
                                                 page_size, item_bytes, s)                                             \
                               : launch<H, false>(top_k, dbt, hcl, dbl, host, dev, out, rpi, seq, lru, nreal, bs,      \
                                                  buffer_stride0, host_stride, lru_stride0, topk_stride, out_stride,   \
                                                  page_size, item_bytes, s);
  DHS_CASE(4096)
  DHS_CASE(8192)
#undef DHS_CASE
  return -1;
}
