// Checksums of a parameter's elements that do not depend on the layout holding them (see the Note).
// Torch-free; internal to src/checkpoint/ (the vectorised loop in element_sums.cpp).
//
// Note [Element checksums]
// A load into another layout reads only the byte ranges it needs (Note [Placement in the
// manifest]), so no rank reads a whole file or block whose CRC-32 it could check. Instead every
// parameter carries, per section (its values and each optimizer state buffer), the sum modulo 2^64
// of a hash of (global element index, element bits) over its unsplit, unpadded elements: each
// saving rank adds its own elements (the sum does not care who holds what), the manifest stores
// each folder's sum, and after a load every rank adds the hashes of the elements it staged; one
// all-reduce over the world gives, per parameter, the sum over all copies now held and how many
// elements they cover. A tensor held k times (replicated over the tensor ranks, or tied between the
// first and the last stage) covers k times its elements and must sum to k times the saved sum. A
// flipped bit, a swapped element, a piece read from the wrong offset or placed at the wrong index
// changes the sum (the hash mixes the index in), on every rank alike, before any optimizer changes.
//
// The hash is ElementHash::Multiply from format version 3 (kMultiplyHashFormatVersion) and
// ElementHash::Mix64 before; the loader uses the one its checkpoint's version names. Mix64 is
// splitmix64's finaliser over the index and the bits: three 64-bit multiplies an element, which
// bound the asynchronous save's writer (82% of its CPU once the manifest's JSON was gone: perf,
// BERT-base), and AVX-512 has no fast 64-bit multiply. Multiply is (bits ^ a(i)) * b(i) mod 2^64,
// with a(i) the top 32 bits of i * 0x9E3779B97F4A7C15 and b(i) those of i * 0xD6E8FEB86659FD93,
// made odd (both products mod 2^64: Weyl sequences, which a loop over consecutive indices advances
// by an add). For 4-byte elements that is one 32 x 32 -> 64-bit multiply (vpmuludq: 8 products an
// instruction) with adds, shifts and logic, which keep up with the rate memory delivers the
// elements (the writer's sums: 0.07 -> 0.05 s per 660 MB shard under load, a plain read of it
// 0.04-0.05 s); an asynchronous save's copy now computes them from the loads its store uses
// (copy_blocks_summed, Note [Shard images]). It keeps the guarantees above, one of them outright: a changed element changes its
// term by d * b(i), with d = (x' ^ a) - (x ^ a) nonzero, |d| < 2^64 and b(i) odd, so nonzero mod
// 2^64: a single flipped bit or changed element is always caught (Mix64: with probability
// 1 - 2^-64). An element moved to another index meets other a and b; two errors cancel only where
// their terms do mod 2^64.
#pragma once

#include <cstdint>
#include <cstring>

#include "checkpoint/placement.hpp"
#include "shardopt/detail/state_sections.hpp"

namespace shardopt::detail {

// Which hash a checkpoint's element sums use (see the Note).
enum class ElementHash { Mix64, Multiply };

// splitmix64's finaliser over the index and the element's bits (ElementHash::Mix64).
inline uint64_t element_hash(uint64_t index, uint64_t bits) {
  uint64_t z = index * 0x9E3779B97F4A7C15ull + bits * 0xD6E8FEB86659FD93ull + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ElementHash::Multiply: the index terms a(i) and b(i) (odd) from the top halves of two Weyl
// sequences, and the hash.
inline constexpr uint64_t kMultiplyA = 0x9E3779B97F4A7C15ull, kMultiplyB = 0xD6E8FEB86659FD93ull;
inline uint64_t multiply_hash(uint64_t index, uint64_t bits) {
  const uint64_t a = (index * kMultiplyA) >> 32;
  const uint64_t b = ((index * kMultiplyB) >> 32) | 1u;
  return (bits ^ a) * b;
}

inline uint64_t element_hash(ElementHash h, uint64_t index, uint64_t bits) {
  return h == ElementHash::Mix64 ? element_hash(index, bits) : multiply_hash(index, bits);
}

// What local elements [begin, begin + numel) of copy `p` add: their hashes (padding rows skipped),
// and how many elements that is. `data` holds the elements, `elem_bytes` (<= 8) each.
struct ElementSum {
  uint64_t sum = 0;
  int64_t count = 0;
};

// The sum of element_hash(h, begin + j, 4-byte element j) over j < numel: element_sum_of's loop
// for unsplit 4-byte elements, vectorised where the CPU allows (element_sums.cpp), the same result.
uint64_t consecutive_element_sum_u32(ElementHash h, uint64_t begin, int64_t numel,
                                     const unsigned char* bytes);

// element_sum with the element size fixed at compile time (`Bits`: an unsigned integer type of
// the element's size): a memcpy of a constant size compiles to one load, where one of a run-time
// size stayed a call per element and made this loop the save's largest cost (bench: async
// checkpoint's writer thread).
template <typename Bits>
ElementSum element_sum_of(ElementHash h, const TensorPlacement& p, int64_t begin, int64_t numel,
                          const unsigned char* bytes) {
  ElementSum out;
  if (!p.split()) {  // the index is the local one: a loop without divisions
    if constexpr (sizeof(Bits) == 4) {
      return {consecutive_element_sum_u32(h, static_cast<uint64_t>(begin), numel, bytes), numel};
    }
    for (int64_t j = 0; j < numel; ++j) {
      Bits bits;
      std::memcpy(&bits, bytes + j * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
      out.sum += element_hash(h, static_cast<uint64_t>(begin + j), static_cast<uint64_t>(bits));
    }
    out.count = numel;
    return out;
  }
  int64_t inner = 1;
  for (size_t k = static_cast<size_t>(p.dim) + 1; k < p.shape.size(); ++k) inner *= p.shape[k];
  const int64_t rows = p.shape[p.dim];
  for (int64_t j = 0; j < numel; ++j) {
    const int64_t local = begin + j;
    const int64_t row = local / inner, within = local % inner;
    const int64_t outer = row / rows, g = p.rank * rows + row % rows;
    if (g >= p.full) continue;  // padding
    const int64_t global = (outer * p.full + g) * inner + within;
    Bits bits;
    std::memcpy(&bits, bytes + j * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
    out.sum += element_hash(h, static_cast<uint64_t>(global), static_cast<uint64_t>(bits));
    ++out.count;
  }
  return out;
}

// What local elements [begin, begin + numel) of copy `p` add: their hashes (padding rows skipped),
// and how many elements that is. `data` holds the elements, `elem_bytes` (1, 2, 4 or 8) each.
inline ElementSum element_sum(ElementHash h, const TensorPlacement& p, int64_t begin,
                              int64_t numel, const void* data, int elem_bytes) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  switch (elem_bytes) {
    case 1: return element_sum_of<uint8_t>(h, p, begin, numel, bytes);
    case 2: return element_sum_of<uint16_t>(h, p, begin, numel, bytes);
    case 4: return element_sum_of<uint32_t>(h, p, begin, numel, bytes);
    default: return element_sum_of<uint64_t>(h, p, begin, numel, bytes);
  }
}

// What elements [param_begin, param_begin + numel) of a parameter of `param_numel` elements add
// in a state section indexed by `ix` (Note [Quantised state in checkpoints]): `entries` points at
// their first entry. A block section hashes the parameter's block indices, local to the copy
// (such state is never re-split), a packed one only a small parameter's elements.
inline ElementSum section_sum(ElementHash h, const SectionIndex& ix, const TensorPlacement& p,
                              int64_t param_begin, int64_t numel, int64_t param_numel,
                              const void* entries, int elem_bytes) {
  if (ix.packed && !ix.small(param_numel)) return {};
  if (ix.block == 1) return element_sum(h, p, param_begin, numel, entries, elem_bytes);
  const int64_t first = param_begin / ix.block;
  const int64_t end = (param_begin + numel + ix.block - 1) / ix.block;
  return element_sum(h, TensorPlacement{}, first, end - first, entries, elem_bytes);
}

}  // namespace shardopt::detail
