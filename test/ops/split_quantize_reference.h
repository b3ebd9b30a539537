#pragma once
// The CPU reference quantizer of split_quantize, written from the definitions in
// kernels/split_quantize.h and TransformerEngine's recipes (never calling the kernel): each
// split's scales, amaxes and both FP8 copies for per-tensor current and delayed scaling and
// 1x128 and 128x128 block scaling. The split-quantize tests compare the kernel with it; the FP8
// layer tests dequantize its copies for their float64 reference.

#include <torch/torch.h>
#include <torchmoe/kernels/split_quantize.h>
#include <torchmoe/ops/quantize.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace torchmoe::test {

using torchmoe::kernels::round_up_columnwise;
using torchmoe::ops::Fp8Format;
using torchmoe::ops::QuantizeScaling;
using torchmoe::ops::SplitQuantizeOptions;

constexpr int64_t kBlock = 128;

inline float format_max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }
inline torch::Dtype fp8_dtype(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t r4(int64_t n) { return ceil_div(n, 4) * 4; }

// The largest finite value of the input type: a block scale that overflows fp32 becomes this.
inline float input_max(torch::Dtype dtype) {
  if (dtype == torch::kHalf) return 65504.0f;
  if (dtype == torch::kBFloat16) return 3.38953139e38f;
  return FLT_MAX;
}

// TE's amax → scale: floor at epsilon; 0, inf, NaN → 1; fp8_max / amax rounded to nearest; an
// infinite quotient → value_for_inf; optionally the mantissa cleared.
inline float scale_from_amax(float amax, float max, bool pow2, float epsilon, float value_for_inf) {
  if (amax < epsilon) amax = epsilon;
  if (std::isinf(amax) || amax == 0.0f || std::isnan(amax)) return 1.0f;
  float scale = max / amax;
  if (std::isinf(scale)) scale = value_for_inf;
  if (pow2) {
    uint32_t bits;
    std::memcpy(&bits, &scale, 4);
    bits &= 0xff800000u;
    std::memcpy(&scale, &bits, 4);
  }
  return scale;
}

// max |x| over the elements, NaN ignored (0 when empty).
inline float nan_amax(const torch::Tensor& x) {
  if (x.numel() == 0) return 0.0f;
  const torch::Tensor a = x.to(torch::kFloat).abs();
  return torch::where(a.isnan(), torch::zeros_like(a), a).max().item<float>();
}

// The FP8 cast: round to nearest even, saturating finite values and inf to ±max, NaN kept.
inline torch::Tensor cast_fp8(const torch::Tensor& scaled, Fp8Format f) {
  return scaled.clamp(-format_max(f), format_max(f)).to(fp8_dtype(f));
}

struct Expected {
  torch::Tensor data;       // [M, K] fp8 (rows past the splits: zero, never compared)
  torch::Tensor colwise;    // [M·K] fp8
  torch::Tensor scaled;     // [M, K] float: x·scale before rounding, rowwise copy
  torch::Tensor scaled_t;   // float: the same for the columnwise copy (its padding: 0)
  torch::Tensor scale_inv;  // per tensor [G]; blocks: rowwise block scales (padding 0)
  torch::Tensor colwise_scale_inv;
  torch::Tensor amax;  // [G]
};

struct Split {
  int64_t start, rows;
};

inline std::vector<Split> clamp_splits(const std::vector<int64_t>& sizes, int64_t rows) {
  std::vector<Split> splits;
  int64_t start = 0;
  for (int64_t s : sizes) {
    const int64_t m = std::min(std::max<int64_t>(s, 0), rows - start);
    splits.push_back({start, m});
    start += m;
  }
  return splits;
}

inline Expected reference(const torch::Tensor& input, const std::vector<int64_t>& sizes,
                          const SplitQuantizeOptions& o, const torch::Tensor& given_scale = {}) {
  const torch::Tensor x = input.cpu().to(torch::kFloat);
  const torch::Tensor delayed_scale = given_scale.defined() ? given_scale.cpu() : given_scale;
  const int64_t rows = x.size(0), k = x.size(1), kb_count = ceil_div(k, kBlock);
  const int64_t groups = static_cast<int64_t>(sizes.size());
  const float max = format_max(o.format), eps = static_cast<float>(o.amax_epsilon);
  const bool pow2 = o.power_of_2_scales;
  const float inf_value = input_max(input.scalar_type());
  const std::vector<Split> splits = clamp_splits(sizes, rows);
  Expected e;
  e.scaled = torch::zeros({rows, k});
  e.scaled_t = torch::zeros({torchmoe::kernels::columnwise_elements(rows, k, groups)});
  e.amax = torch::zeros({groups});
  const bool block = torchmoe::kernels::is_block_scaling(o.scaling);
  if (block) {
    e.scale_inv =
        torch::zeros({torchmoe::kernels::rowwise_block_scales(o.scaling, rows, k, groups)});
    e.colwise_scale_inv =
        torch::zeros({torchmoe::kernels::columnwise_block_scales(o.scaling, rows, k, groups)});
  } else {
    e.scale_inv = torch::zeros({groups});
  }
  // Σ_{h<g} r4(m_h), Σ_{h<g} ceil(m_h/128), Σ_{h<g} r4(ceil(m_h/128)), Σ_{h<g} r16(m_h).
  int64_t rows4 = 0, tiles = 0, tiles4 = 0, rows16 = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const auto [start, m] = splits[g];
    const int64_t mb_count = ceil_div(m, kBlock);
    const torch::Tensor xs = x.narrow(0, start, m);
    e.amax[g] = nan_amax(xs);
    torch::Tensor scaled_rows = torch::zeros({m, k}), scaled_cols = torch::zeros({k, m});
    auto abs_block = [&](int64_t r, int64_t nr, int64_t c, int64_t nc) {
      return nan_amax(xs.narrow(0, r, nr).narrow(1, c, nc));
    };
    if (!block) {
      const float scale = o.scaling == QuantizeScaling::kDelayed
                              ? delayed_scale[g].item<float>()
                              : scale_from_amax(e.amax[g].item<float>(), max, pow2, eps, FLT_MAX);
      e.scale_inv[g] = 1.0f / scale;
      scaled_rows = xs * scale;
      scaled_cols = scaled_rows.t();
    } else if (o.scaling == QuantizeScaling::kBlock1x128) {
      const int64_t base_r = kb_count * rows4, base_c = r4(k) * tiles;
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        const int64_t c = kb * kBlock, nc = std::min(kBlock, k - c);
        for (int64_t r = 0; r < m; ++r) {
          const float s = scale_from_amax(abs_block(r, 1, c, nc), max, pow2, eps, inf_value);
          e.scale_inv[base_r + kb * r4(m) + r] = 1.0f / s;
          scaled_rows.narrow(0, r, 1).narrow(1, c, nc).copy_(xs.narrow(0, r, 1).narrow(1, c, nc) *
                                                             s);
        }
      }
      for (int64_t mb = 0; mb < mb_count; ++mb) {
        const int64_t r = mb * kBlock, nr = std::min(kBlock, m - r);
        for (int64_t col = 0; col < k; ++col) {
          const float s = scale_from_amax(abs_block(r, nr, col, 1), max, pow2, eps, inf_value);
          e.colwise_scale_inv[base_c + mb * r4(k) + col] = 1.0f / s;
          scaled_cols.narrow(0, col, 1).narrow(1, r, nr).copy_(
              xs.narrow(0, r, nr).narrow(1, col, 1).t() * s);
        }
      }
    } else {
      const int64_t base_r = r4(kb_count) * tiles, base_c = kb_count * tiles4;
      for (int64_t mb = 0; mb < mb_count; ++mb) {
        const int64_t r = mb * kBlock, nr = std::min(kBlock, m - r);
        for (int64_t kb = 0; kb < kb_count; ++kb) {
          const int64_t c = kb * kBlock, nc = std::min(kBlock, k - c);
          const float s = scale_from_amax(abs_block(r, nr, c, nc), max, pow2, eps, inf_value);
          e.scale_inv[base_r + mb * r4(kb_count) + kb] = 1.0f / s;
          e.colwise_scale_inv[base_c + kb * r4(mb_count) + mb] = 1.0f / s;
          scaled_rows.narrow(0, r, nr).narrow(1, c, nc).copy_(xs.narrow(0, r, nr).narrow(1, c, nc) *
                                                              s);
        }
      }
      scaled_cols = scaled_rows.t();
    }
    e.scaled.narrow(0, start, m).copy_(scaled_rows);
    const int64_t m16 = round_up_columnwise(m);
    e.scaled_t.narrow(0, k * rows16, k * m16).view({k, m16}).narrow(1, 0, m).copy_(scaled_cols);
    rows16 += m16;
    rows4 += r4(m);
    tiles += mb_count;
    tiles4 += r4(mb_count);
  }
  e.data = cast_fp8(e.scaled, o.format);
  e.colwise = cast_fp8(e.scaled_t, o.format);
  return e;
}

}  // namespace torchmoe::test
