// The checks of a pretraining data file's header and lengths before anything indexes by them
// (issue 42, Note [Sizes from files] in src/checkpoint/format.hpp). Torch-free.
#include <fmt/format.h>

#include "data.hpp"

namespace bert {

std::string check_data_layout(const DataHeader& h, const char* base, uint64_t file_bytes) {
  const uint64_t n = h.num_instances, L = h.max_seq_length, P = h.max_predictions;
  if (h.file_bytes != file_bytes) {
    return fmt::format("is truncated or corrupt: the header's file_bytes is {}, the file has {}",
                       h.file_bytes, file_bytes);
  }
  // Each section [offset, offset + n * per_instance * element) in order, aligned, inside the file:
  // checked without wrapping around, so that no count in the header reaches past the file.
  const struct {
    const char* field;
    uint64_t offset, per_instance, element, next;
  } sections[] = {
      {"input_ids_offset", h.input_ids_offset, L, 4, h.masked_positions_offset},
      {"masked_positions_offset", h.masked_positions_offset, P, 2, h.masked_labels_offset},
      {"masked_labels_offset", h.masked_labels_offset, P, 4, h.meta_offset},
      {"meta_offset", h.meta_offset, 4, 2, file_bytes}};
  uint64_t previous_end = sizeof(DataHeader);
  for (const auto& sec : sections) {
    uint64_t bytes = 0, end = 0;
    if (sec.offset < previous_end || sec.offset % sec.element != 0 ||
        __builtin_mul_overflow(n, sec.per_instance, &bytes) ||
        __builtin_mul_overflow(bytes, sec.element, &bytes) ||
        __builtin_add_overflow(sec.offset, bytes, &end) || end > sec.next) {
      return fmt::format("is truncated or corrupt: header field {} ({}) with num_instances {} "
                         "does not fit the file's {} bytes",
                         sec.field, sec.offset, n, file_bytes);
    }
    previous_end = end;
  }
  if (n == 0) return "holds no instances";
  // Every instance's lengths stay inside its row: instance() and batch() index by them.
  const auto* meta = reinterpret_cast<const int16_t*>(base + h.meta_offset);
  for (uint64_t i = 0; i < n; ++i) {
    const int16_t* m = meta + i * 4;
    if (m[0] < 0 || static_cast<uint64_t>(m[0]) > L || m[1] < 0 || m[1] > m[0] || m[2] < 0 ||
        static_cast<uint64_t>(m[2]) > P || (m[3] != 0 && m[3] != 1)) {
      return fmt::format("is corrupt: instance {} has lengths ({}, {}, {}, {}) outside "
                         "max_seq_length {} and max_predictions {}",
                         i, m[0], m[1], m[2], m[3], L, P);
    }
  }
  return "";
}

}  // namespace bert
