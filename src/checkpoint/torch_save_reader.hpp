// Reads torch.save / torch::pickle_save files (zip + protocol-2 pickle) as torch::pickle_load
// does, within bounds torch's reader does not keep. Note [Bounds on torch.save files]: torch's
// unpickler (1.13 to 2.x) allocates what the bytes claim before it reads them: a string's stated
// length (up to 2^64), a memo table as long as the largest memo id (2^32 entries), a zip entry's
// stated uncompressed size (deflated entries), and it makes each tensor's storage as many bytes
// as the pickle's element count says, over a record that may hold fewer, so a copy reads past it.
// So before torch reads: every zip entry is stored (torch.save compresses none, so miniz bounds
// each by the file), every length-prefixed pickle argument fits in the bytes after it, memo ids
// come in order and no opcode takes more from the stack than it holds (torch 1.13 pops an empty
// stack: a SEGV); after: every storage lies inside the record it was made from.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <string>

namespace shardopt::detail {

// The value a torch.save file of `size` bytes at `data` holds. A bound broken is
// Error{Checkpoint} starting with `what`; torch's own refusals pass through as torch threw them.
c10::IValue read_torch_save(const char* data, size_t size, const std::string& what);

}  // namespace shardopt::detail
