// Stream order between torch's current CUDA stream and shardopt's own CUDA work, without CUDA
// libtorch headers: only c10's device-guard interface, which a CUDA torch fills in at load time.
// Used by libshardopt_nccl and libshardopt_cuda (both compile wherever nvcc and the CUDA runtime
// are, against a CPU or CUDA libtorch alike).
//
// Note [Torch's default stream]
// torch's default CUDA stream (stream id 0) is the legacy default stream, whose cudaStream_t is
// nullptr; kernels for work on it launch there directly. Any other current stream (a user's
// torch.cuda.stream(...)) is reached through events: the work waits for the torch stream, runs
// on a stream of ours, and the torch stream waits for it. Neither blocks the host.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime.h>

#include "shardopt/error.hpp"

namespace shardopt::detail {

inline const c10::impl::DeviceGuardImplInterface* cuda_guard_impl() {
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)
             ? c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
             : nullptr;
}

// torch's current stream on `device` (null optional-like: id 0 when torch has no CUDA).
inline c10::Stream torch_current_stream(int device) {
  const auto* impl = cuda_guard_impl();
  const c10::Device d(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  return impl ? impl->getStream(d) : c10::Stream(c10::Stream::DEFAULT, d);
}

inline bool is_torch_default_stream(const c10::Stream& s) { return s.id() == 0; }

// Makes `stream` wait for everything queued so far on torch's current stream of `device`.
inline void stream_waits_for_torch(cudaStream_t stream, int device, const char* context) {
  const auto* impl = cuda_guard_impl();
  if (impl == nullptr) return;  // no CUDA torch: nothing of torch's to wait for
  const c10::Stream torch_stream = torch_current_stream(device);
  if (stream == nullptr && is_torch_default_stream(torch_stream)) return;  // the same stream
  void* event = nullptr;
  impl->record(&event, torch_stream, static_cast<c10::DeviceIndex>(device),
               c10::EventFlag::PYTORCH_DEFAULT);
  const cudaError_t rc = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0);
  impl->destroyEvent(event, static_cast<c10::DeviceIndex>(device));
  SHARDOPT_CHECK(rc == cudaSuccess, Internal, "{}: cudaStreamWaitEvent failed: {}", context,
                 cudaGetErrorString(rc));
}

// Makes torch's current stream of `device` wait for everything queued so far on `stream`.
inline void torch_waits_for_stream(cudaStream_t stream, int device, const char* context) {
  const auto* impl = cuda_guard_impl();
  if (impl == nullptr) return;
  const c10::Stream torch_stream = torch_current_stream(device);
  if (stream == nullptr && is_torch_default_stream(torch_stream)) return;
  cudaEvent_t event = nullptr;
  cudaError_t rc = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (rc == cudaSuccess) rc = cudaEventRecord(event, stream);
  if (rc == cudaSuccess) impl->block(event, torch_stream);
  if (event != nullptr) cudaEventDestroy(event);
  SHARDOPT_CHECK(rc == cudaSuccess, Internal, "{}: recording a CUDA event failed: {}", context,
                 cudaGetErrorString(rc));
}

}  // namespace shardopt::detail
