"""The SGLang double's model: what sglang's tc_piecewise prefill backend compiles and captures.

sglang (0.5.14-0.5.21) compiles the model's forward with torch.compile(fullgraph=True), the token
dimension marked dynamic, then captures one CUDA graph per prefill size, largest first
(prefill_cuda_graph_runner.py: `reversed(self.capture_num_tokens)`); a dynamo break anywhere in the
forward ends the server at start. This is that forward at a size a CPU runs: a block-FP8 Llama-
shaped stack whose linear layers follow sglang 0.5.17's fp8_utils.py with --fp8-gemm-backend
flashinfer_deepgemm:

  1 <= M < 32  the GEMM of a FlashInfer-shaped library (labgemm: its kernel selection asks the
               host's real FlashInfer for the CUDA version, then its JIT loader stats the prebuilt
               module), or, where the host's sglang made that GEMM an opaque custom op
               (flashinfer-fp8-blockscale-custom-op), an opaque op;
  M >= 32      sglang's triton fallback: the activation quantized per token group through an
               sglang-shaped kernel loader (labkernels: get_kernel imports the kernel's module on
               first call), then the block-scaled matmul.

Weights are seeded (as sglang's dummy loader seeds each parameter), so two servers on one config
compute the same numbers: /generate's input_token_logprobs, compiled at a captured size or eager
past the largest, are what the audit compares. Dims are the config's, capped for a CPU.
"""

from __future__ import annotations

import bisect
import importlib.util

BLOCK = 128


def lab_kernels_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("labgemm", "labkernels"))


def block_fp8(config: dict) -> bool:
    """A block-FP8 checkpoint (what takes sglang's FP8 block-scale linear): its config's
    quantization_config names fp8 with a weight_block_size."""
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("quant_method") == "fp8" and bool(quant.get("weight_block_size"))


def default_prefill_sizes(max_bs: int = 2048) -> list[int]:
    """sglang 0.5.17's default tc_piecewise capture sizes (server_args.py
    _generate_prefill_cuda_graph_batch_sizes; 2048 is its documented prefill default)."""
    sizes = (list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, 1025, 64)) + list(range(1280, 4097, 256)) + list(range(4608, max_bs + 1, 512)))
    return [s for s in sizes if s <= max_bs]


def cuda_graph_config(server_args: dict) -> dict:
    """--cuda-graph-config (sglang 0.5.14+: per-phase settings as JSON), parsed; {} where absent or bad."""
    import json
    cfg = server_args.get("cuda_graph_config")
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            cfg = None
    return cfg if isinstance(cfg, dict) else {}


def prefill_sizes(server_args: dict) -> list[int]:
    """The sizes the release captures for these server args: --cuda-graph-bs-prefill (or the
    cuda_graph_config JSON's prefill bs), else the defaults up to the prefill max."""
    prefill = cuda_graph_config(server_args).get("prefill")
    prefill = prefill if isinstance(prefill, dict) else {}
    sizes = prefill.get("bs") or server_args.get("cuda_graph_bs_prefill")
    if sizes:
        return sorted({int(s) for s in sizes})
    max_bs = server_args.get("cuda_graph_max_bs_prefill") or prefill.get("max_bs") or 2048
    chunked = server_args.get("chunked_prefill_size")
    if chunked and int(chunked) > 0:
        max_bs = min(int(max_bs), int(chunked))
    return default_prefill_sizes(int(max_bs))


def _dims(config: dict) -> dict:
    def capped(key, default, cap):
        value = int(config.get(key) or default)
        return max(BLOCK, min(cap, value) // BLOCK * BLOCK)

    hidden = capped("hidden_size", 256, 512)
    return {"hidden": hidden, "inter": capped("intermediate_size", 4 * hidden, 1024),
            "layers": max(1, min(int(config.get("num_hidden_layers") or 2), 4)),
            "vocab": max(256, min(int(config.get("vocab_size") or 2048), 4096))}


class PiecewiseModel:
    def __init__(self, config: dict, opaque_gemm: bool):
        import torch

        self.torch = torch
        d = self.dims = _dims(config)
        gen = torch.Generator().manual_seed(1234)

        def uniform(*shape):
            return (torch.rand(*shape, generator=gen) * 2 - 1) * 0.5

        def fp8_weight(n, k):
            w = uniform(n, k)
            scale = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448.0
            q = (w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK) / scale[:, None, :, None]).view(n, k)
            return q.to(torch.float8_e4m3fn), scale.float()

        self.embed = uniform(d["vocab"], d["hidden"]).to(torch.bfloat16)
        self.layers = [{"gate_up": fp8_weight(2 * d["inter"], d["hidden"]), "down": fp8_weight(d["hidden"], d["inter"])}
                       for _ in range(d["layers"])]
        self.lm_head = uniform(d["vocab"], d["hidden"]).to(torch.bfloat16)
        self.gemm = self._opaque_gemm() if opaque_gemm else None
        self.compiled = None
        self.sizes: list[int] = []

    def _opaque_gemm(self):
        """The host's sglang made FlashInfer's GEMM an opaque custom op: so is this one."""
        torch = self.torch
        from labgemm.gemm import fp8_blockscale_gemm

        try:
            @torch.library.custom_op("sglang_double::fp8_blockscale_gemm", mutates_args=(),
                                     schema="(Tensor x, Tensor w, Tensor ws) -> Tensor")
            def gemm(x, w, ws):
                return fp8_blockscale_gemm(x, w, None, ws, torch.bfloat16)

            @gemm.register_fake
            def _(x, w, ws):
                return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)
        except RuntimeError:  # registered already in this process
            gemm = torch.ops.sglang_double.fp8_blockscale_gemm
        return gemm

    def linear(self, x, weight):
        """sglang's flashinfer_deepgemm_w8a8_block_fp8_linear_with_fallback."""
        torch = self.torch
        w, ws = weight
        m = x.shape[0]
        if 1 <= m < 32:
            if self.gemm is not None:
                return self.gemm(x, w, ws)
            from labgemm import fp8_blockscale_gemm
            return fp8_blockscale_gemm(x, w, None, ws, torch.bfloat16)
        # triton_w8a8_block_fp8_linear: the activation quantized per token group, then the GEMM
        from labkernels.ops.quantization import per_token_group_quant
        q, xs = per_token_group_quant(x, None, None, BLOCK)
        n, k = w.shape
        wd = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK) * ws[:, None, :, None]
        xd = q.float().view(m, k // BLOCK, BLOCK) * xs[..., None]
        return (xd.view(m, k) @ wd.view(n, k).T).to(torch.bfloat16)

    def _norm(self, h):
        hf = h.float()
        return (hf * self.torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(self.torch.bfloat16)

    def forward(self, ids):
        torch = self.torch
        h = self.embed[ids]
        inter = self.dims["inter"]
        for layer in self.layers:
            gate_up = self.linear(self._norm(h), layer["gate_up"])
            act = torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
            h = h + self.linear(act.to(torch.bfloat16), layer["down"])
        logits = self._norm(h).float() @ self.lm_head.float().T
        return torch.log_softmax(logits, dim=-1)

    def capture(self, sizes: list[int], log) -> None:
        """torch.compile the forward (fullgraph, tokens dynamic) and run it at every size, largest
        first, as sglang captures: a break raises dynamo's own Unsupported."""
        torch = self.torch
        self.sizes = sorted(sizes)
        self.compiled = torch.compile(self.forward, fullgraph=True, backend="eager")
        for n in reversed(self.sizes):
            log(f"Capturing num tokens (num_tokens={n} avail_mem=11.49 GB)")
            ids = torch.zeros(n, dtype=torch.long)
            torch._dynamo.maybe_mark_dynamic(ids, 0)
            self.compiled(ids)

    def logprobs(self, ids: list[int]) -> list[float | None]:
        """sglang's input_token_logprobs: the first token has none; token i given tokens < i.
        Within the captured sizes the compiled forward at the padded size runs (sglang pads a
        prefill to its bucket); past them, eager."""
        torch = self.torch
        n = len(ids)
        tokens = torch.tensor([i % self.dims["vocab"] for i in ids], dtype=torch.long)
        at = bisect.bisect_left(self.sizes, n)
        if self.compiled is not None and at < len(self.sizes):
            padded = torch.zeros(self.sizes[at], dtype=torch.long)
            padded[:n] = tokens
            out = self.compiled(padded)[:n]
        else:
            out = self.forward(tokens)
        picked = out[:-1].gather(1, tokens[1:, None]).squeeze(1)
        return [None] + [float(v) for v in picked]
