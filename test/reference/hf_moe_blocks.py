#!/usr/bin/env python3
"""Reference data for torchmoe's MoELayer, produced by Hugging Face `transformers`' own MoE blocks.

Usage: hf_moe_blocks.py OUTDIR   ->   OUTDIR/<arch>.safetensors for every arch in ARCHS.

Each file holds, for one tiny random float64 block (CPU, fixed seed):
  input [2, 5, H], grad_output, output, grad_input (all shaped like input),
  param.<name> / grad.<name> for every parameter, buffer.<name> for every buffer,
  router.indices int64 [T, k] (rows sorted ascending) and router.weights float64 [T, k] (same order).
Metadata: arch, config (JSON), transformers_version, torch_version, notes.

The blocks are HF's unmodified modules, with two deliberate deviations (recorded in `notes`):
  * routers that compute in float32 even for float64 weights get their forward replaced by a copy of the
    same math without the casts, so the whole reference is float64 (asserted: only precision changed);
  * experts use the "eager" per-expert loop (config._experts_implementation = "eager").
Tiny configs are built from the config classes: no hub access is needed (HF_HUB_OFFLINE is forced).
"""
import argparse
import json
import os
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import (DeepseekV3Config, GptOssConfig, Llama4TextConfig, MixtralConfig, OlmoeConfig,
                          Qwen2MoeConfig, Qwen3MoeConfig)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

H = 64          # hidden size
SHAPE = (2, 5, H)  # input [batch, seq, hidden]; T = 10 tokens


# ---------------------------------------------------------------------------------------------------------------
# float64 router forwards. Each is a verbatim copy of the HF router's forward (transformers 5.25.0) with only the
# float32 casts removed; main() asserts that the original and the copy agree to float32 precision and pick the
# same experts.
# ---------------------------------------------------------------------------------------------------------------
def softmax_topk_router_f64(self, hidden_states):
    """MixtralTopKRouter / OlmoeTopKRouter / Qwen3MoeTopKRouter / Qwen2MoeTopKRouter.forward.
    Removed: `softmax(router_logits.float())` (Mixtral), `softmax(..., dtype=torch.float)` (the others).
    Mixtral has no norm_topk_prob attribute and always renormalises, hence the getattr default."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    if getattr(self, "norm_topk_prob", True):
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def deepseek_v3_router_f64(self, hidden_states):
    """DeepseekV3TopkRouter.forward. Removed: `.type(torch.float32)` on hidden_states and on self.weight."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (
        scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    )
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(-1, self.num_group, self.num_experts // self.num_group)
        .reshape(-1, self.num_experts)
    )
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def llama4_router_f64(self, hidden_states):
    """Llama4Router.forward. Removed: `sigmoid(router_scores.float()).to(router_scores.dtype)`."""
    router_logits = F.linear(hidden_states, self.weight, self.bias)  # == super().forward (nn.Linear, no bias)
    router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=1)
    router_scores = torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value)
    router_scores = torch.nn.functional.sigmoid(router_scores)
    return router_scores, router_logits


def routing_tuple(arch, router_out, top_k):
    """(indices [T,k], weights [T,k]) from a router's raw output, whatever its return convention."""
    if arch == "llama4":  # (dense sigmoid scores [T, E] with 0 for unselected experts, logits)
        scores, logits = router_out
        idx = torch.topk(logits, top_k, dim=1)[1]
        return idx, scores.gather(1, idx)
    _, weights, idx = router_out  # (logits, top-k weights, top-k indices)
    return idx, weights


def sorted_routing(idx, w):
    idx_sorted, perm = idx.sort(dim=-1)
    return idx_sorted, w.gather(-1, perm)


# ---------------------------------------------------------------------------------------------------------------
# Architectures: config class, block class, tiny config, router submodule name, patched router forward, seed,
# and per-parameter std overrides.
# ---------------------------------------------------------------------------------------------------------------
COMMON = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
ARCHS = {
    "mixtral": (MixtralConfig, MixtralSparseMoeBlock,
                dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
                "gate", softmax_topk_router_f64, 1001, {}),
    "olmoe": (OlmoeConfig, OlmoeSparseMoeBlock,
              dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
              "gate", softmax_topk_router_f64, 1002, {}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeSparseMoeBlock,
                  dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
                  "gate", softmax_topk_router_f64, 1003, {}),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeSparseMoeBlock,
                  dict(moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True),
                  "gate", softmax_topk_router_f64, 1004, {}),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3MoE,
                    dict(moe_intermediate_size=32, n_routed_experts=16, n_group=4, topk_group=2,
                         num_experts_per_tok=4, routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True),
                    "gate", deepseek_v3_router_f64, 1005, {"gate.e_score_correction_bias": 0.1}),
    # gpt_oss's router already computes in the input dtype: nothing to patch. Its gate_up_proj gets a larger std
    # so that pre-activations cross swiglu_limit = 7 and both clamps are exercised (asserted below).
    "gpt_oss": (GptOssConfig, GptOssMLP,
                dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, swiglu_limit=7.0),
                "router", None, 1006, {"experts.gate_up_proj": 0.6}),
    "llama4": (Llama4TextConfig, Llama4TextMoe,
               dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=1),
               "router", llama4_router_f64, 1007, {}),
}
DEFAULT_STD = 0.2  # x ~ N(0, 1), so router logits have std ~1.6: routing is far from uniform and from ties


def check_gpt_oss_clamps(block, x2d, idx):
    """Make sure the reference covers both clamp branches of GptOssExperts._apply_gate."""
    ex = block.experts
    gate_up = torch.einsum("th,tkhi->tki", x2d, ex.gate_up_proj[idx]) + ex.gate_up_proj_bias[idx]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    n_gate, n_up = int((gate > ex.limit).sum()), int((up.abs() > ex.limit).sum())
    assert n_gate > 0 and n_up > 0, f"clamps not exercised: gate>{ex.limit}: {n_gate}, |up|>{ex.limit}: {n_up}"
    return f"gpt_oss: {n_gate}/{gate.numel()} gate values > limit, {n_up}/{up.numel()} |up| values > limit"


def build(arch):
    cfg_cls, block_cls, kwargs, router_name, router_f64, seed, std_over = ARCHS[arch]
    config = cfg_cls(**COMMON, **kwargs)
    config._experts_implementation = "eager"  # the reference per-expert loop, not batched/grouped kernels
    torch.manual_seed(seed)
    block = block_cls(config).double().eval()  # eval: no router jitter (training-only); autograd unaffected
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            t.normal_(0.0, std_over.get(name, DEFAULT_STD))
    return config, block, router_name, router_f64, seed


def run_arch(arch, outdir):
    config, block, router_name, router_f64, seed = build(arch)
    router = getattr(block, router_name)
    notes = ["experts: config._experts_implementation='eager'"]

    torch.manual_seed(seed + 1)
    x = torch.randn(SHAPE, dtype=torch.float64)
    x2d = x.reshape(-1, H)

    # Lift the float32 router casts; check that only precision changed.
    with torch.no_grad():
        idx_ref, w_ref = sorted_routing(*routing_tuple(arch, router(x2d), config.num_experts_per_tok))
        if router_f64 is not None:
            router.forward = types.MethodType(router_f64, router)
            notes.append(f"{type(router).__name__}.forward replaced by a float64 copy without its float32 casts")
        else:
            notes.append(f"{type(router).__name__}: no float32 cast in HF, not patched")
        idx, w = sorted_routing(*routing_tuple(arch, router(x2d), config.num_experts_per_tok))
    assert w.dtype == torch.float64, f"{arch}: patched router weights are {w.dtype}"
    assert torch.equal(idx, idx_ref), f"{arch}: float64 router picks different experts than HF's"
    torch.testing.assert_close(w, w_ref.double(), rtol=1e-6, atol=1e-7, msg=lambda m: f"{arch} router: {m}")
    max_rel = ((w - w_ref.double()).abs() / w.abs().clamp_min(1e-30)).max().item()
    notes.append(f"router weights float64 vs HF original: max rel diff {max_rel:.2e}, identical indices")
    if arch == "gpt_oss":
        notes.append(check_gpt_oss_clamps(block, x2d, idx))

    # Forward + backward through the unmodified block.
    x.requires_grad_(True)
    out = block(x)
    if isinstance(out, tuple):  # gpt_oss: (hidden, router_scores); llama4: (hidden, router_logits)
        out = out[0]
    if out.shape != x.shape:  # llama4 returns [T, H]
        notes.append(f"output reshaped from {list(out.shape)} to input shape {list(x.shape)}")
        out = out.reshape(x.shape)
    assert out.dtype == torch.float64
    torch.manual_seed(seed + 2)
    grad_output = torch.randn(out.shape, dtype=torch.float64)
    out.backward(grad_output)

    tensors = {"input": x.detach(), "grad_output": grad_output, "output": out.detach(), "grad_input": x.grad,
               "router.indices": idx.to(torch.int64), "router.weights": w}
    no_grad = []
    for name, p in block.named_parameters():
        tensors[f"param.{name}"] = p.detach()
        if p.grad is None:  # cannot happen unless a parameter is unused; stored as zeros and noted
            no_grad.append(name)
        tensors[f"grad.{name}"] = p.grad if p.grad is not None else torch.zeros_like(p)
    for name, b in block.named_buffers():
        tensors[f"buffer.{name}"] = b.detach()
    if no_grad:
        notes.append("no gradient (stored as zeros): " + ", ".join(no_grad))
    unused = sorted(set(range(block.experts.num_experts)) - set(idx.flatten().tolist()))
    if unused:
        notes.append(f"experts chosen by no token: {unused}")

    metadata = {"arch": arch, "config": config.to_json_string(use_diff=False),
                "transformers_version": transformers.__version__, "torch_version": torch.__version__,
                "notes": "; ".join(notes)}
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    path = os.path.join(outdir, f"{arch}.safetensors")
    save_file(tensors, path, metadata=metadata)
    return path, tensors, metadata


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    for arch in ARCHS:
        path, tensors, meta = run_arch(arch, args.outdir)
        print(f"== {arch}: {path}")
        for k, v in tensors.items():
            print(f"   {k:40s} {str(v.dtype).removeprefix('torch.'):8s} {list(v.shape)}")
        print(f"   notes: {meta['notes']}")


if __name__ == "__main__":
    main()
