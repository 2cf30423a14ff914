// Issue 33's side-by-side: SGLang's HiSparse swap-in kernel (`load_cache_to_device_buffer_kernel`, from the
// sglang wheel's kernels/jit/csrc/kvcacheio/hisparse.cuh), launched unmodified through a C entry point that
// bench/peer/hisparse_peer.py calls with ctypes. Nothing of the peer is vendored: bench/peer/build.py extracts
// its headers from the wheel into .peer/ (git-ignored) and compiles this file against them at benchmark time.
//
// One instantiation per (hot buffer size, SkipIO): top-k 2,048 tokens, 960 threads (the block size sglang serves
// with: HiSparseCoordinator's swap_in_block_size, sparsity/factory.py's default), MLA (one K buffer), linear host /
// device rows of item_bytes, token-granular top-k, no miss-plan recording, int64 seq_lens and req_pool_indices.
// SkipIO = 1 elides only the row copies (the peer's own timing probe: its plan alone). Returns a cudaError_t
// (0 = launched), or -1 for a hot size not instantiated.
//
// Not 256 (load_cache_to_device_buffer_mla's Python default): the kernel's CUDA prefix sums (hisparse.cuh,
// warp_inclusive_scan over s_chunk_offset / s_evict_chunk_offset, one window of WARP_SIZE chunks per iteration of
// NUM_WARPS chunks) are right only with NUM_WARPS >= WARP_SIZE / 2: with 8 warps the window's last 24 lanes read
// the previous iteration's running sums as counts, the offsets blow up from the third iteration on, and the hit /
// evict / miss writes (s_lru_slots_out[...], then req_device_buffer_locs[evict_slot]) leave their arrays: the
// illegal address of session 50's first peer call. bench/peer/hisparse_peer.py refuses a library whose
// dhs_peer_block_size() breaks that bound (or that lacks it: a build from before this fix).
#include <kvcacheio/hisparse.cuh>
#include <cuda_runtime.h>

namespace {
constexpr int kBlock = 960;  // threads per request (block): sglang's swap_in_block_size

template <int HOT, bool SKIP>
int launch(const int32_t* top_k, int32_t* dbt, const int64_t* hcl, const int32_t* dbl, const void* host, void* dev,
           int32_t* out, const int64_t* rpi, const int64_t* seq, int16_t* lru, const int32_t* nreal, int64_t bs,
           int64_t buffer_stride0, int64_t host_stride, int64_t lru_stride0, int64_t topk_stride, int64_t out_stride,
           int64_t page_size, int64_t item_bytes, cudaStream_t stream) {
  constexpr int BLOCK = kBlock, TOPK = 2048;
  static_assert(BLOCK % 32 == 0 && BLOCK / 32 >= 16 && BLOCK <= 1024, "the peer's scans need >= 16 warps");
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

// The launch's threads per block (bench/peer/hisparse_peer.py checks it before any launch).
extern "C" int dhs_peer_block_size() { return kBlock; }

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
