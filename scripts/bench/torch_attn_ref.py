#!/usr/bin/env python3
"""PyTorch's causal SDPA alone, forward and backward, for shapes set beside `bench_gpu --attn`.

    python3 torch_attn_ref.py --shapes 16,12,1024,64/4,12,4096,64

Each shape is B,H,T,D (q, k, v of (B, H, T, D), bf16). Times SDPA's default choice and the flash
backend forced, with CUDA events (median of 20 after 3 warm-ups); the backward alone is the
time of forward + backward minus the forward. Prints one JSON line per (shape, backend) with
TFLOP/s counted as bench_gpu does (causal: forward 2·B·H·T²·D, backward 2.5 times that).
"""
import argparse, json, statistics
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(f, reps=20, warmup=3):
    for _ in range(warmup):
        f()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="16,12,1024,64/4,12,4096,64/2,12,8192,64")
    a = p.parse_args()
    for shape in a.shapes.split("/"):
        B, H, T, D = map(int, shape.split(","))
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dy = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * B * H * D * T * T
        for name, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION])):
            ctx = sdpa_kernel(backends) if backends else torch.autocast("cuda", enabled=False)
            with ctx:
                fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                both = median_ms(lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dy))
            bwd = both - fwd
            print(json.dumps({"impl": "torch", "backend": name, "attn": [B, H, T, D],
                              "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3),
                              "fwd_tflops": round(flops / fwd / 1e9, 1),
                              "bwd_tflops": round(2.5 * flops / bwd / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
