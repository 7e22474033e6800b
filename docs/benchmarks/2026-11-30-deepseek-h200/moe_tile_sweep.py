"""Sweep the fused MoE GEMM kernels' tile configs at V2-Lite shapes (decode b1/b8/b64, prefill 1024)."""
import itertools, json, sys, torch, triton
from triton.testing import do_bench
from pegainfer.models.deepseek import moe_kernels as mk
E, H, I, K = 64, 2048, 1408, 6
dev = "cuda"
gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
res = []
for tokens in (1, 8, 64, 1024):
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    experts = torch.rand(tokens, E, device=dev).topk(K).indices.int()
    weights = torch.rand(tokens, K, device=dev)
    pairs = tokens * K
    for bm in ({1: (16,), 8: (16,), 64: (16, 64), 1024: (64,)}[tokens]):
        sp, be = mk.dispatch(experts, 0, E, bm)
        touched = experts.unique().numel()
        hid = torch.empty(pairs, I, device=dev, dtype=torch.bfloat16)
        out = torch.empty(pairs, H, device=dev, dtype=torch.float32)
        for bn, bk, w, s in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4)):
            if bn * bk > 128 * 128: continue
            try:
                f1 = lambda: mk._gate_up_kernel[(be.numel(), triton.cdiv(I, bn))](
                    x, gate_up, hid, sp, be, pairs, K, H, I, x.stride(0), gate_up.stride(0), gate_up.stride(1), hid.stride(0),
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, num_warps=w, num_stages=s)
                f2 = lambda: mk._down_kernel[(be.numel(), triton.cdiv(H, bn))](
                    hid, down, out, sp, be, weights, pairs, H, I, hid.stride(0), down.stride(0), down.stride(1), out.stride(0),
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, num_warps=w, num_stages=s)
                t1 = do_bench(f1, warmup=5, rep=30) * 1e3; t2 = do_bench(f2, warmup=5, rep=30) * 1e3
            except Exception as e:  # out of shared memory etc.
                continue
            ideal_us = touched * 3 * I * H * 2 / 4.2e12 * 1e6
            res.append(dict(tokens=tokens, bm=bm, bn=bn, bk=bk, warps=w, stages=s, gate_up_us=t1, down_us=t2, ideal_total_us=ideal_us))
    best1 = min((r for r in res if r["tokens"] == tokens), key=lambda r: r["gate_up_us"])
    best2 = min((r for r in res if r["tokens"] == tokens), key=lambda r: r["down_us"])
    cur = [r for r in res if r["tokens"] == tokens and r["bn"] == 64 and r["bk"] == 64 and r["warps"] == 4 and r["stages"] == 3]
    print("tokens", tokens, "ideal", round(best1["ideal_total_us"], 1), "best gate_up", {k: best1[k] for k in ("bm","bn","bk","warps","stages","gate_up_us")},
          "best down", {k: best2[k] for k in ("bm","bn","bk","warps","stages","down_us")}, "current", [(c["bm"], round(c["gate_up_us"],1), round(c["down_us"],1)) for c in cur], flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
json.dump(res, open(sys.argv[1], "w"), indent=1)
