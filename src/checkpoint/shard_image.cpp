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
#include "checkpoint/image_copy.hpp"
#include "checkpoint/manifest.hpp"  // placement_of_param, kSavedElementHash
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

// `numel` elements of `elem` bytes from `src` to the image at byte `at`; with `sum`, their hashes
// are added there, at indices from `index` of the parameter placed as `place` (null: padding).
struct ImageRun {
  int64_t at = 0;
  const uint8_t* src = nullptr;
  int64_t numel = 0;
  int64_t elem = 4;
  kernels::ValueKind kind = kernels::ValueKind::Float32;
  bool check = false;
  const TensorPlacement* place = nullptr;
  int64_t index = 0;
  uint64_t* sum = nullptr;

  ImageRun part(int64_t first, int64_t n) const {
    ImageRun r = *this;
    r.at += first * elem;
    r.src += first * elem;
    r.numel = n;
    r.index += first;
    return r;
  }
};

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
  for (int i = 0; i < static_cast<int>(layout.slots.size()); ++i) {
    places_.push_back(placement_of_param(a, i));
  }
  sums_.assign(places_.size() * sections_.size(), 0);
  summed_.assign(sections_.size(), 0);
  for (size_t k = 0; k < sections_.size(); ++k) {
    summed_[k] = k == 0 || state_.maps[k - 1].index().elementwise() ? 1 : 0;
  }
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

bool ShardImage::copy_chunks(const ImageRun& r) {
  bool finite = true;
  const int64_t n = r.numel * r.elem;
  for (int64_t done = 0; done < n;) {
    // Chunks end on multiples of kImageChunk in the file: all but a run's ends are whole blocks,
    // and each a whole number of elements (sections start 64-byte aligned).
    const int64_t end = std::min(n, (r.at + done) / kImageChunk * kImageChunk + kImageChunk - r.at);
    copy(r.at + done, r.src + done, end - done);
    const int64_t e0 = done / r.elem, e1 = end / r.elem;  // the chunk's elements in the run
    if (r.check && finite) {
      kernels::CheckSegment segment;
      segment.kind = r.kind;
      segment.data = const_cast<uint8_t*>(r.src + done);
      segment.numel = e1 - e0;
      finite = !kernels::check_finite(segment).non_finite;
    }
    if (r.sum != nullptr) {
      *r.sum += detail::element_sum(kSavedElementHash, *r.place, r.index + e0, e1 - e0,
                                    r.src + done, static_cast<int>(r.elem))
                    .sum;
    }
    done = end;
  }
  return finite;
}

bool ShardImage::copy_run(const ImageRun& r) {
  // One pass over whole blocks of 4-byte elements at consecutive indices (an unsplit
  // parameter's, or padding's); the edges and the other runs in chunks.
  static_assert(kSavedElementHash == ElementHash::Multiply, "copy_blocks_summed's hash");
  const int64_t b0 = (r.at + kBlockBytes - 1) / kBlockBytes;
  const int64_t b1 = (r.at + r.numel * r.elem) / kBlockBytes;
  if (r.elem != 4 || (r.place != nullptr && r.place->split()) || b1 <= b0) return copy_chunks(r);
  const int64_t head = (b0 * kBlockBytes - r.at) / 4, body = (b1 - b0) * kBlockBytes / 4;
  const bool head_finite = copy_chunks(r.part(0, head));
  const SummedCopy c =
      copy_blocks_summed(data_ + b0 * kBlockBytes, r.src + head * 4, b1 - b0, blocks_.data() + b0,
                         static_cast<uint64_t>(r.index + head));
  std::fill(covered_.begin() + b0, covered_.begin() + b1, 1);
  if (r.sum != nullptr) *r.sum += c.sum;
  const bool tail_finite = copy_chunks(r.part(head + body, r.numel - head - body));
  return head_finite && !c.non_finite && tail_finite;
}

void ShardImage::take(ShardAccess& a) {
  const auto& layout = a.layout();
  const int rank = a.comm()->rank();
  const size_t sections = sections_.size();
  std::fill(covered_.begin(), covered_.end(), 0);
  std::fill(sums_.begin(), sums_.end(), 0);
  for (size_t b = 0; b < buckets_; ++b) {
    const int bucket = static_cast<int>(b);
    const auto& bl = layout.buckets[b];
    const ShardRange owned = bl.owned(rank);
    for (size_t k = 0; k < sections; ++k) {
      const ImageSection& s = sections_[k];
      const at::Tensor src = owned_slice(a, static_cast<int>(k), bucket);
      const auto [first, count] =
          k == 0 ? std::pair<int64_t, int64_t>{bl.shard_offset, bl.shard}
                 : state_.slice(layout, static_cast<int>(k) - 1, bucket);
      SHARDOPT_INTERNAL_ASSERT(src.device().is_cpu() && src.is_contiguous() &&
                                   src.scalar_type() == s.dtype && src.numel() == count,
                               "checkpoint: bucket {}'s slice of section {} no longer fits the "
                               "snapshot's image", b, s.name);
      ImageRun slice;
      slice.elem = static_cast<int64_t>(c10::elementSize(s.dtype));
      slice.src = static_cast<const uint8_t*>(src.data_ptr());
      slice.at = s.offset + first * slice.elem;
      slice.numel = count;
      slice.kind = s.dtype == at::kFloat      ? kernels::ValueKind::Float32
                   : s.dtype == at::kBFloat16 ? kernels::ValueKind::BFloat16
                                              : kernels::ValueKind::Float16;
      // Note [Quantised state in checkpoints]: only element-wise sections hold one entry per
      // element, which the check and the element sums take.
      slice.check = summed_[k] && checkable(s.dtype);
      bool finite = true;
      if (!summed_[k]) {
        finite = copy_run(slice);
      } else {
        SHARDOPT_INTERNAL_ASSERT(count == bl.shard, "section {} of bucket {} holds {} entries "
                                 "for {} elements", s.name, b, count, bl.shard);
        // The slice as runs: each parameter's piece (summed at its indices), padding between.
        int64_t done = 0;
        for (const int q : bl.pieces) {
          const ParamPiece& p = layout.pieces[static_cast<size_t>(q)];
          const ShardRange mine = intersect({p.offset, p.offset + p.numel}, owned);
          if (mine.empty()) continue;
          const int64_t r0 = mine.begin - owned.begin, r1 = mine.end - owned.begin;
          SHARDOPT_INTERNAL_ASSERT(r0 >= done, "bucket {}'s pieces out of order", b);
          finite = copy_run(slice.part(done, r0 - done)) && finite;
          ImageRun run = slice.part(r0, r1 - r0);
          run.place = &places_[static_cast<size_t>(p.param)];
          run.index = mine.begin - p.offset + p.param_offset;
          run.sum = &sums_[static_cast<size_t>(p.param) * sections + k];
          finite = copy_run(run) && finite;
          done = r1;
        }
        finite = copy_run(slice.part(done, count - done)) && finite;
      }
      finite_[k * buckets_ + b] = slice.check && finite ? 1 : 0;
    }
  }
  // The blocks no copy covered whole: the header, padding, and the runs' edges.
  for (size_t q = 0; q < blocks_.size(); ++q) {
    if (!covered_[q]) {
      blocks_[q] = crc32c(data_ + static_cast<int64_t>(q) * kBlockBytes, kBlockBytes);
    }
  }
}

}  // namespace shardopt::detail
