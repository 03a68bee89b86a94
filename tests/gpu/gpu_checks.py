"""One-GPU checks that go with benchmarks/actor_bench.py (run by it with --checks, world size 1):

- the bf16 matmul peak of this GPU (8192^3), what the benchmark's percentages are against;
- varlen attention (one flash call per packed micro-batch, mcore_rl.models.layers.VarlenCoreAttention)
  against the per-sequence SDPA path on a 2-layer model of real widths, both in bf16 against the
  same model in fp32: logits and every gradient; and the two attention calls' fwd+bwd time;
- the output head's memory and time, autograd log-prob chain vs mcore_rl.models.head, as bytes per
  (token x vocabulary) and (response token x vocabulary): what the planner's head term uses.
"""

from __future__ import annotations

import time

import torch

GiB = 1 << 30


def _timed(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def matmul_peak(size: int = 8192, iters: int = 30) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size**3 / _timed(lambda: a @ b, iters)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def attention_check(hf_cfg: dict, lengths=(3000, 1500, 700, 2900), device: str = "cuda") -> dict:
    from mcore_rl.loop import micro_batches
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.layers import _varlen_call

    if _varlen_call() is None:
        return dict(available=False, torch=torch.__version__)
    hf = HFModel.from_dict({**hf_cfg, "num_hidden_layers": 2})
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    tokens = torch.randint(0, hf.vocab_size, (len(lengths), width), generator=g)
    attn = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()  # left-padded
    packed = micro_batches.pack(tokens, attn, 0, list(range(len(lengths)))).to(device)
    weight = torch.randn(hf.vocab_size, generator=g).to(device)
    out = {}
    ref_state = None
    for name, dtype, attention in (("fp32", torch.float32, "sdpa"), ("sdpa", torch.bfloat16, "sdpa"),
                                   ("varlen", torch.bfloat16, "varlen")):
        model = build_model(hf, transformer_config(hf, dtype=dtype, cpu=device == "cpu"), attention=attention)
        if ref_state is None:
            ref_state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        own = model.state_dict()
        model.load_state_dict({k: v.to(own[k].dtype) for k, v in ref_state.items()}, strict=False)
        logits = model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed.seq_params())
        (logits.float() * weight).sum().backward()
        out[name] = (logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                               if p.grad is not None})
        del model, logits
    res = dict(available=True, tokens=sum(lengths))
    ref_logits, ref_grads = out.pop("fp32")
    for name, (logits, grads) in out.items():
        res[f"{name}_logits_err"] = _rel(logits, ref_logits)
        res[f"{name}_grads_err_max"] = max(_rel(grads[n], ref_grads[n]) for n in ref_grads)
        res[f"{name}_grads"] = len(grads)
    res["ok"] = (res["varlen_grads"] == res["sdpa_grads"]
                 and res["varlen_logits_err"] <= 1.5 * res["sdpa_logits_err"] + 1e-3
                 and res["varlen_grads_err_max"] <= 1.5 * res["sdpa_grads_err_max"] + 1e-3)
    if device == "cuda":
        res.update(_attention_times(hf, packed))
    return res


def _attention_times(hf, packed) -> dict:
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_rl.models.config import transformer_config
    from mcore_rl.models.layers import SDPACoreAttention, VarlenCoreAttention

    cfg = transformer_config(hf, dtype=torch.bfloat16)
    T, heads = packed.length, hf.num_attention_heads
    dk, dv = hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim
    q, k = (torch.randn(T, heads, dk, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(T, heads, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(T, heads * dv, device="cuda", dtype=torch.bfloat16)
    psp = packed.seq_params()
    times = {}
    for name, cls in (("sdpa", SDPACoreAttention), ("varlen", VarlenCoreAttention)):
        layer = cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, softmax_scale=dk ** -0.5)
        times[f"{name}_attention_fwd_bwd_ms"] = 1e3 * _timed(
            lambda: layer(q, k, v, None, packed_seq_params=psp).backward(grad), 10)
    return times


def head_memory(vocab: int, tokens: int = 8192) -> dict:
    """Peak bytes of the log-prob head beyond its input logits, both ways, at two response shares;
    solved for a * T * V + b * n * V (bytes per logit entry)."""
    from mcore_rl.models.head import logprob_entropy

    V, T = vocab, tokens
    logits = torch.randn(T, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    res = {}
    for fused in (False, True):
        peaks = []
        for n in (T // 2, T // 8):
            rows = torch.randperm(T, device="cuda")[:n]
            target = torch.randint(0, V, (n,), device="cuda")

            def step():
                x = logits * 1.0  # a fresh tensor, as the output layer's
                sel = x[rows]
                del x
                if fused:
                    lp, ent = logprob_entropy(sel, target, 1.0, True)
                else:
                    la = torch.log_softmax(sel.float(), -1)
                    lp, ent = la.gather(-1, target[:, None])[:, 0], -(la.exp() * la).sum(-1)
                del sel
                (lp.sum() + 0.01 * ent.sum()).backward()
                logits.grad = None

            step()  # compile / warm up
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            peaks.append((n, torch.cuda.max_memory_allocated() - base, _timed(step, 3)))
        (n1, p1, t1), (n2, p2, t2) = peaks
        b = (p1 - p2) / ((n1 - n2) * V)
        a = (p1 - b * n1 * V) / (T * V)
        name = "fused" if fused else "plain"
        res[name] = dict(bytes_per_TV=a, bytes_per_nV=b, peak_gib_half=p1 / GiB, ms_half=1e3 * t1,
                         peak_gib_eighth=p2 / GiB, ms_eighth=1e3 * t2)
    res["tokens"] = T
    return res


def run_all(hf_cfg: dict) -> dict:
    # the attention comparison runs the norms and SwiGLU eagerly (the same in all three models):
    # compiling them for fp32 and bf16 would cost more time than the whole comparison
    with torch.compiler.set_stance("force_eager"):
        attention = attention_check(hf_cfg)
    return dict(matmul_peak_tflops=matmul_peak() / 1e12, attention=attention,
                head=head_memory(hf_cfg["vocab_size"]), device=torch.cuda.get_device_name(),
                torch=torch.__version__)
