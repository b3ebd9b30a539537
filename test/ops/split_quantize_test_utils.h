#pragma once
// Helpers of the split-quantize tests (test_split_quantize.cpp, test_split_quantize_sources.cpp):
// comparisons of FP8 bytes and scales that allow only round-to-nearest ties, the block layouts'
// masks, inputs, and a run of split_quantize on host splits.

#include <torchmoe/kernels/split_quantize.h>
#include <torchmoe/ops/glu.h>
#include <torchmoe/ops/quantize.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ops/split_quantize_reference.h"
#include "test_utils.h"

namespace torchmoe::test {

using torchmoe::AmaxComputeAlgo;
using torchmoe::ops::SplitQuantized;

// FP8 values equal, both NaN, or an exact tie of round-to-nearest (the unrounded value halfway
// between the two): the only disagreement a correct cast may have.
inline void check_fp8(const torch::Tensor& actual, const torch::Tensor& expected,
                      const torch::Tensor& unrounded, const std::string& what) {
  INFO(what);
  REQUIRE(actual.defined());
  REQUIRE(actual.scalar_type() == expected.scalar_type());
  REQUIRE(actual.numel() == expected.numel());
  const torch::Tensor a = actual.cpu().to(torch::kFloat).view(-1);
  const torch::Tensor b = expected.to(torch::kFloat).view(-1);
  const torch::Tensor v = unrounded.reshape(-1);
  const torch::Tensor same = (a == b) | (a.isnan() & b.isnan());
  const torch::Tensor tie = ((v - a).abs() == (v - b).abs()) & (a != b);
  const torch::Tensor bad = ~(same | tie);
  const int64_t count = bad.sum().item<int64_t>();
  if (count > 0) {
    const int64_t i = bad.nonzero()[0][0].item<int64_t>();
    INFO(count << " mismatches; first at " << i << ": got " << a[i].item<float>() << ", expected "
               << b[i].item<float>() << " (unrounded " << v[i].item<float>() << ")");
    CHECK(count == 0);
  }
}

// Only the entries the layout defines: `mask` marks them (padding is unspecified).
inline void check_scales(const torch::Tensor& actual, const torch::Tensor& expected,
                         const torch::Tensor& mask, const std::string& what) {
  INFO(what);
  REQUIRE(actual.defined());
  REQUIRE(actual.numel() == expected.numel());
  const torch::Tensor a = actual.cpu().masked_select(mask), b = expected.masked_select(mask);
  REQUIRE_FALSE(a.isnan().any().item<bool>());
  REQUIRE_FALSE(a.isinf().any().item<bool>());
  const torch::Tensor bad = a != b;
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero()[0][0].item<int64_t>();
    INFO("first mismatch at defined entry " << i << ": got " << a[i].item<float>() << ", expected "
                                            << b[i].item<float>());
    CHECK(false);
  }
}

// Which entries of the block scale buffers the splits define.
inline std::pair<torch::Tensor, torch::Tensor> block_masks(const std::vector<int64_t>& sizes,
                                                           int64_t rows, int64_t k,
                                                           QuantizeScaling scaling) {
  const int64_t groups = static_cast<int64_t>(sizes.size()), kbs = ceil_div(k, kBlock);
  torch::Tensor row_mask = torch::zeros(
      {torchmoe::kernels::rowwise_block_scales(scaling, rows, k, groups)}, torch::kBool);
  torch::Tensor col_mask = torch::zeros(
      {torchmoe::kernels::columnwise_block_scales(scaling, rows, k, groups)}, torch::kBool);
  int64_t rows4 = 0, tiles = 0, tiles4 = 0;
  for (const Split& s : clamp_splits(sizes, rows)) {
    const int64_t mbs = ceil_div(s.rows, kBlock);
    if (scaling == QuantizeScaling::kBlock1x128) {
      for (int64_t kb = 0; kb < kbs; ++kb) {
        row_mask.narrow(0, kbs * rows4 + kb * r4(s.rows), s.rows).fill_(true);
      }
      for (int64_t mb = 0; mb < mbs; ++mb)
        col_mask.narrow(0, r4(k) * tiles + mb * r4(k), k).fill_(true);
    } else {
      for (int64_t mb = 0; mb < mbs; ++mb) {
        row_mask.narrow(0, r4(kbs) * tiles + mb * r4(kbs), kbs).fill_(true);
      }
      for (int64_t kb = 0; kb < kbs; ++kb) {
        col_mask.narrow(0, kbs * tiles4 + kb * r4(mbs), mbs).fill_(true);
      }
    }
    rows4 += r4(s.rows);
    tiles += mbs;
    tiles4 += r4(mbs);
  }
  return {row_mask, col_mask};
}

// Σ_g m_g of the clamped splits: the rows the rowwise copy holds.
inline int64_t used_rows(const std::vector<int64_t>& sizes, int64_t rows) {
  int64_t total = 0;
  for (const Split& s : clamp_splits(sizes, rows)) total += s.rows;
  return total;
}

// Σ_g r16(m_g) of the clamped splits: the columnwise blocks' total width.
inline int64_t padded_rows(const std::vector<int64_t>& sizes, int64_t rows) {
  int64_t total = 0;
  for (const Split& s : clamp_splits(sizes, rows)) total += round_up_columnwise(s.rows);
  return total;
}

// Rows [0, used) of the rowwise copy and the columnwise blocks, padding included.
inline void check_against_reference(const SplitQuantized& q, const Expected& e,
                                    const std::vector<int64_t>& sizes,
                                    const SplitQuantizeOptions& o, int64_t rows, int64_t k) {
  const int64_t used = used_rows(sizes, rows);
  const int64_t used_t = k * padded_rows(sizes, rows);
  if (o.rowwise) {
    check_fp8(q.data.narrow(0, 0, used), e.data.narrow(0, 0, used), e.scaled.narrow(0, 0, used),
              "rowwise data");
  }
  if (o.columnwise) {
    check_fp8(q.columnwise_data.narrow(0, 0, used_t), e.colwise.narrow(0, 0, used_t),
              e.scaled_t.narrow(0, 0, used_t), "columnwise data");
  }
  CHECK(torch::equal(q.amax.cpu(), e.amax));
  if (torchmoe::kernels::is_block_scaling(o.scaling)) {
    const auto [row_mask, col_mask] = block_masks(sizes, rows, k, o.scaling);
    if (o.rowwise) check_scales(q.scale_inv, e.scale_inv, row_mask, "rowwise block scale_inv");
    if (o.columnwise) {
      check_scales(q.columnwise_scale_inv, e.colwise_scale_inv, col_mask,
                   "columnwise block scale_inv");
    }
  } else {
    check_scales(q.scale_inv, e.scale_inv, torch::ones({e.scale_inv.numel()}, torch::kBool),
                 "scale_inv");
  }
}

// Two results of the same rows bit for bit: both copies (the rowwise one over the splits' rows,
// the columnwise one up to its used width; past them, unwritten), the scales and the amaxes.
inline void check_same(const SplitQuantized& a, const SplitQuantized& b,
                       const std::vector<int64_t>& sizes, int64_t rows, int64_t k) {
  const int64_t used = used_rows(sizes, rows);
  CHECK(torch::equal(a.data.narrow(0, 0, used).view(torch::kByte),
                     b.data.narrow(0, 0, used).view(torch::kByte)));
  const int64_t used_t = k * padded_rows(sizes, rows);
  CHECK(torch::equal(a.columnwise_data.narrow(0, 0, used_t).view(torch::kByte),
                     b.columnwise_data.narrow(0, 0, used_t).view(torch::kByte)));
  CHECK(torch::equal(a.scale_inv, b.scale_inv));
  if (a.columnwise_scale_inv.defined()) {
    CHECK(torch::equal(a.columnwise_scale_inv, b.columnwise_scale_inv));
  }
  CHECK(torch::equal(a.amax, b.amax));
}

// A spread of magnitudes (so that block scales differ) with exact ties of the FP8 grid mixed in.
inline torch::Tensor make_input(int64_t rows, int64_t k, torch::Dtype dtype, uint64_t seed) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::Tensor x = torch::randn({rows, k}, gen) *
                    torch::pow(2.0, torch::randint(-6, 6, {rows, 1}, gen).to(torch::kFloat));
  return x.to(dtype).to(torch::kCUDA);
}

inline std::string scaling_name(QuantizeScaling s) {
  switch (s) {
    case QuantizeScaling::kCurrent:
      return "current";
    case QuantizeScaling::kDelayed:
      return "delayed";
    case QuantizeScaling::kBlock1x128:
      return "block1x128";
    case QuantizeScaling::kBlock128x128:
      return "block128x128";
  }
  return "?";
}

// The scale argument of a call with this scaling: delayed scaling's given scales, else none.
inline torch::Tensor scale_argument(QuantizeScaling scaling, int64_t groups) {
  if (scaling != QuantizeScaling::kDelayed) return {};
  // Powers of two and not: 0.5 ... 40 (some saturate e4m3 for the larger inputs).
  return (torch::linspace(0.5, 40.0, groups).to(torch::kFloat)).to(torch::kCUDA);
}

inline SplitQuantized run(const torch::Tensor& x, const std::vector<int64_t>& sizes,
                          const SplitQuantizeOptions& o, const torch::Tensor& scale) {
  return torchmoe::ops::split_quantize(x, sizes, o, scale);
}

}  // namespace torchmoe::test
