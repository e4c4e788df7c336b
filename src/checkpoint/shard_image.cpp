// Shard images (Note [Shard images] in shard_image.hpp): the layout, and the copy with its block
// checksums and non-finite check.
#include "checkpoint/shard_image.hpp"

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "checkpoint/crc32c.hpp"
#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/staging.hpp"
#include "kernels/finite.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/error.hpp"

namespace shardopt::detail {

namespace {
constexpr int64_t kHugePage = int64_t{2} << 20;

at::Tensor owned_slice(ShardAccess& a, int k, int bucket) {
  return k == 0 ? a.owned_param_slice(bucket) : a.owned_state_slice(k - 1, bucket);
}

bool checkable(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}
}  // namespace

std::array<char, 64> shard_header(int rank, int world) {
  std::array<char, 64> header{};
  std::memcpy(header.data(), kMagic, sizeof(kMagic));
  const uint32_t fields[3] = {static_cast<uint32_t>(kCheckpointFormatVersion),
                              static_cast<uint32_t>(rank), static_cast<uint32_t>(world)};
  std::memcpy(header.data() + 8, fields, sizeof(fields));
  return header;
}

bool ShardImage::fits(ShardAccess& a) {
  const StateSections state = state_sections(a);
  for (size_t b = 0; b < a.layout().buckets.size(); ++b) {
    for (int k = 0; k <= a.state_buffer_count(); ++k) {
      const at::Tensor t = owned_slice(a, k, static_cast<int>(b));
      const auto dtype = k == 0 ? a.master_dtype() : state.dtypes[static_cast<size_t>(k - 1)];
      if (!t.device().is_cpu() || !t.is_contiguous() || t.scalar_type() != dtype) return false;
    }
  }
  return true;
}

ShardImage::ShardImage(ShardAccess& a) : layout_(&a.layout()) {
  const auto& layout = a.layout();
  buckets_ = layout.buckets.size();
  state_ = state_sections(a);
  const std::vector<std::string> names = optimizer_state_names(a);
  int64_t end = kAlign;  // after the header
  for (int k = 0; k <= a.state_buffer_count(); ++k) {
    ImageSection s;
    s.name = k == 0 ? std::string("param") : "state/" + names[static_cast<size_t>(k - 1)];
    s.dtype = k == 0 ? a.master_dtype() : state_.dtypes[static_cast<size_t>(k - 1)];
    s.entries = k == 0 ? layout.shard_numel : state_.maps[static_cast<size_t>(k - 1)].size();
    s.offset = (end + kAlign - 1) / kAlign * kAlign;
    end = s.offset + s.entries * static_cast<int64_t>(c10::elementSize(s.dtype));
    sections_.push_back(std::move(s));
  }
  bytes_ = end;
  // Transparent huge pages where the kernel gives them: O_DIRECT pins the buffer's pages for
  // every write (get_user_pages: per 4 KiB page otherwise), and the copy takes fewer TLB misses.
  const int64_t allocated = (bytes_ + kHugePage - 1) / kHugePage * kHugePage;
  void* p = nullptr;
  SHARDOPT_CHECK(::posix_memalign(&p, kHugePage, static_cast<size_t>(allocated)) == 0, OutOfMemory,
                 "checkpoint: cannot allocate the asynchronous save's snapshot of {} bytes",
                 allocated);
#ifdef MADV_HUGEPAGE
  ::madvise(p, static_cast<size_t>(allocated), MADV_HUGEPAGE);  // advice: a refusal is no error
#endif
  data_ = static_cast<uint8_t*>(p);
  std::memset(data_, 0, static_cast<size_t>(allocated));  // padding is zeros, as on disk
  const auto header = shard_header(a.comm()->rank(), a.comm()->size());
  std::memcpy(data_, header.data(), header.size());
  for (const ImageSection& s : sections_) {
    views_.push_back(
        at::from_blob(data_ + s.offset, {s.entries}, at::TensorOptions().dtype(s.dtype)));
  }
  blocks_.assign(static_cast<size_t>(bytes_ / kBlockBytes), 0);
  covered_.assign(blocks_.size(), 0);
  finite_.assign(sections_.size() * buckets_, 0);
}

ShardImage::~ShardImage() { std::free(data_); }

at::Tensor ShardImage::slice(int k, int bucket) const {
  const auto& bl = layout_->buckets[static_cast<size_t>(bucket)];
  if (k == 0) return views_[0].narrow(0, bl.shard_offset, bl.shard);
  const auto [first, count] = state_.slice(*layout_, k - 1, bucket);
  return views_[static_cast<size_t>(k)].narrow(0, first, count);
}

void ShardImage::copy(int64_t at, const uint8_t* src, int64_t n) {
  const int64_t head = std::min(n, (kBlockBytes - at % kBlockBytes) % kBlockBytes);
  std::memcpy(data_ + at, src, static_cast<size_t>(head));
  const int64_t whole = (n - head) / kBlockBytes;
  if (whole > 0) {
    const int64_t first = (at + head) / kBlockBytes;
    crc32c_blocks(data_ + at + head, src + head, whole, kBlockBytes,
                  blocks_.data() + first);
    std::fill(covered_.begin() + first, covered_.begin() + first + whole, 1);
  }
  const int64_t done = head + whole * kBlockBytes;
  std::memcpy(data_ + at + done, src + done, static_cast<size_t>(n - done));
}

void ShardImage::take(ShardAccess& a) {
  const auto& layout = a.layout();
  std::fill(covered_.begin(), covered_.end(), 0);
  for (size_t b = 0; b < buckets_; ++b) {
    const int bucket = static_cast<int>(b);
    const auto& bl = layout.buckets[b];
    for (size_t k = 0; k < sections_.size(); ++k) {
      const ImageSection& s = sections_[k];
      const at::Tensor src = owned_slice(a, static_cast<int>(k), bucket);
      const auto [first, count] =
          k == 0 ? std::pair<int64_t, int64_t>{bl.shard_offset, bl.shard}
                 : state_.slice(layout, static_cast<int>(k) - 1, bucket);
      SHARDOPT_INTERNAL_ASSERT(src.device().is_cpu() && src.is_contiguous() &&
                                   src.scalar_type() == s.dtype && src.numel() == count,
                               "checkpoint: bucket {}'s slice of section {} no longer fits the "
                               "snapshot's image", b, s.name);
      const auto elem = static_cast<int64_t>(c10::elementSize(s.dtype));
      const auto* from = static_cast<const uint8_t*>(src.data_ptr());
      const int64_t at = s.offset + first * elem, n = count * elem;
      // Note [Quantised state in checkpoints]: only element-wise sections hold one entry per
      // element, which the check below takes.
      const bool elementwise = k == 0 || state_.maps[k - 1].index().elementwise();
      const bool check = elementwise && checkable(s.dtype);
      kernels::CheckSegment segment;
      segment.kind = s.dtype == at::kFloat      ? kernels::ValueKind::Float32
                     : s.dtype == at::kBFloat16 ? kernels::ValueKind::BFloat16
                                                : kernels::ValueKind::Float16;
      bool finite = true;
      for (int64_t done = 0; done < n;) {
        // Chunks end on multiples of kImageChunk in the file: all but a slice's ends are whole
        // blocks, and each a whole number of elements (sections start 64-byte aligned).
        const int64_t end = std::min(n, (at + done) / kImageChunk * kImageChunk + kImageChunk - at);
        copy(at + done, from + done, end - done);
        const int64_t e0 = done / elem, e1 = end / elem;  // the chunk's elements in the slice
        if (check && finite) {
          segment.data = const_cast<uint8_t*>(from + done);
          segment.numel = e1 - e0;
          finite = !kernels::check_finite(segment).non_finite;
        }
        done = end;
      }
      finite_[k * buckets_ + b] = check && finite ? 1 : 0;
    }
  }
  // The blocks no copy covered whole: the header, padding, and the slices' edges.
  for (size_t q = 0; q < blocks_.size(); ++q) {
    if (!covered_[q]) {
      blocks_[q] = crc32c(data_ + static_cast<int64_t>(q) * kBlockBytes, kBlockBytes);
    }
  }
}

}  // namespace shardopt::detail
