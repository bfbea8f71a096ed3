"""A random-weight checkpoint at a real model's shape, made where it is served (no weights can be
downloaded to an offline GPU host).

    python -m servops.lab.modelgen OUT --shape llama3-8b --dtype fp8 [--layers N] [--device cuda]

OUT gets what sglang and vLLM load: config.json, generation_config.json, safetensors shards with
model.safetensors.index.json, and a tokenizer (tokenizer.json, tokenizer_config.json with a chat
template, special_tokens_map.json) whose vocabulary fills the model's whole vocab_size, so every
id a random model emits decodes to text. Needs only torch (numpy for the byte view); the
safetensors files and the tokenizer are written by hand, as the GPU kit's make_tiny_model.py
writes its own.

Shapes (SHAPES): `llama3-8b` (Llama-3.1-8B: hidden 4096, 32 layers, GQA 32/8, vocab 128256;
16.1 GB bf16, 9.1 GB fp8), `qwen3-30b-a3b` (Qwen3-30B-A3B: 48 layers of 128 experts, 8 active;
61 GB bf16, 31 GB fp8), and `llama-tiny` / `qwen3moe-tiny` with the same structure at lab sizes.
`--layers N` keeps the shape and changes only its depth.

`--dtype fp8` is the block-FP8 layout sglang reads as quant_method "fp8" with weight_block_size
[128, 128] (as DeepSeek-V3 and Qwen3-FP8 ship): every attention and MLP projection (experts
included) as float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block; embeddings,
norms, the MoE router and lm_head stay bf16 (listed in modules_to_not_convert).

Speed over realism: the weights are drawn from one pool of N(0, 0.02) values, each tensor a
window of it at its own seeded offset. Kernel timings do not depend on the values, but what the
model says does: its text is noise, its outputs stop at max_tokens (it never picks EOS on
purpose), and a MoE router's choices are as uniform as random weights make them, not a trained
model's skew. Same arguments, same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path

BLOCK = 128                      # FP8 scale block, both dimensions
SHARD_BYTES = 5 * 10 ** 9        # as HF checkpoints shard: at most ~5 GB a file
POOL = 1 << 24                   # values drawn once; every tensor is a window of them
WEIGHT_STD = 0.02
FP8_GAIN = 64.0                  # fp8 weight = N(0, 1) x 64 / 64-scale: values use the e4m3 range

SHAPES = {
    # meta-llama/Llama-3.1-8B's config.json
    "llama3-8b": {"arch": "llama", "hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32,
                  "kv_heads": 8, "head_dim": 128, "vocab": 128256, "max_positions": 131072,
                  "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    # Qwen/Qwen3-30B-A3B's config.json
    "qwen3-30b-a3b": {"arch": "qwen3_moe", "hidden": 2048, "intermediate": 6144, "moe_intermediate": 768,
                      "experts": 128, "experts_per_tok": 8, "layers": 48, "heads": 32, "kv_heads": 4,
                      "head_dim": 128, "vocab": 151936, "max_positions": 40960, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6},
    # the lab's: the same structures, small enough for a CPU test (every dimension a multiple of 128)
    "llama-tiny": {"arch": "llama", "hidden": 256, "intermediate": 512, "layers": 2, "heads": 4, "kv_heads": 2,
                   "head_dim": 64, "vocab": 2048, "max_positions": 2048, "rope_theta": 500000.0,
                   "rms_norm_eps": 1e-5},
    "qwen3moe-tiny": {"arch": "qwen3_moe", "hidden": 256, "intermediate": 512, "moe_intermediate": 128,
                      "experts": 8, "experts_per_tok": 2, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64,
                      "vocab": 2048, "max_positions": 2048, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}
DTYPES = ("bf16", "fp8")
SAFETENSORS_DTYPE = {"bf16": "BF16", "fp8": "F8_E4M3", "f32": "F32"}
ITEM_BYTES = {"bf16": 2, "fp8": 1, "f32": 4}

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS, PAD = SPECIALS[:3]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# ---- what the checkpoint holds (pure: no torch) ----------------------------------------------

MAX_LAYERS = 1024  # the deepest real models have a few hundred


def shape_of(name: str, layers: int | None = None) -> dict:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    shape = dict(SHAPES[name], name=name)
    if layers is not None:
        if not 1 <= layers <= MAX_LAYERS:  # (10^9 layers: a list of their tensors filled memory before a byte was written)
            raise ValueError(f"--layers must be 1 to {MAX_LAYERS}, not {layers}")
        shape["layers"] = layers
    return shape


def linear_names(shape: dict, layer: int) -> list[tuple[str, int, int]]:
    """(name, out, in) of layer `layer`'s projections, the ones FP8 quantizes."""
    p = f"model.layers.{layer}."
    hidden, hd = shape["hidden"], shape["head_dim"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    out = [(p + "self_attn.q_proj.weight", q, hidden), (p + "self_attn.k_proj.weight", kv, hidden),
           (p + "self_attn.v_proj.weight", kv, hidden), (p + "self_attn.o_proj.weight", hidden, q)]
    if shape["arch"] == "qwen3_moe":
        inter = shape["moe_intermediate"]
        for e in range(shape["experts"]):
            x = f"{p}mlp.experts.{e}."
            out += [(x + "gate_proj.weight", inter, hidden), (x + "up_proj.weight", inter, hidden),
                    (x + "down_proj.weight", hidden, inter)]
    else:
        inter = shape["intermediate"]
        out += [(p + "mlp.gate_proj.weight", inter, hidden), (p + "mlp.up_proj.weight", inter, hidden),
                (p + "mlp.down_proj.weight", hidden, inter)]
    return out


def tensor_specs(shape: dict, dtype: str) -> list[tuple[str, str, list[int]]]:
    """Every tensor of the checkpoint: (name, dtype key, shape), in the order they are written."""
    hidden, vocab = shape["hidden"], shape["vocab"]
    specs = [("model.embed_tokens.weight", "bf16", [vocab, hidden])]
    for layer in range(shape["layers"]):
        p = f"model.layers.{layer}."
        specs += [(p + "input_layernorm.weight", "bf16", [hidden]),
                  (p + "post_attention_layernorm.weight", "bf16", [hidden])]
        if shape["arch"] == "qwen3_moe":
            specs += [(p + "self_attn.q_norm.weight", "bf16", [shape["head_dim"]]),
                      (p + "self_attn.k_norm.weight", "bf16", [shape["head_dim"]]),
                      (p + "mlp.gate.weight", "bf16", [shape["experts"], hidden])]
        for name, rows, cols in linear_names(shape, layer):
            if dtype == "fp8":
                specs += [(name, "fp8", [rows, cols]),
                          (name[:-len("weight")] + "weight_scale_inv", "f32",
                           [math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)])]
            else:
                specs.append((name, "bf16", [rows, cols]))
    specs += [("model.norm.weight", "bf16", [hidden]), ("lm_head.weight", "bf16", [vocab, hidden])]
    return specs


def nbytes(spec: tuple[str, str, list[int]]) -> int:
    return math.prod(spec[2]) * ITEM_BYTES[spec[1]]


def shards(specs: list, limit: int = SHARD_BYTES) -> list[list]:
    """The specs cut into files of at most `limit` bytes (a bigger tensor alone in its file)."""
    out, size = [[]], 0
    for spec in specs:
        if out[-1] and size + nbytes(spec) > limit:
            out.append([])
            size = 0
        out[-1].append(spec)
        size += nbytes(spec)
    return out


def config(shape: dict, dtype: str) -> dict:
    """config.json as transformers and sglang read it (ids: the tokenizer's specials, at the end)."""
    vocab = shape["vocab"]
    ids = special_ids(vocab)
    cfg = {"model_type": shape["arch"], "torch_dtype": "bfloat16", "vocab_size": vocab,
           "hidden_size": shape["hidden"], "intermediate_size": shape["intermediate"],
           "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
           "num_key_value_heads": shape["kv_heads"], "head_dim": shape["head_dim"], "hidden_act": "silu",
           "max_position_embeddings": shape["max_positions"], "rms_norm_eps": shape["rms_norm_eps"],
           "rope_theta": shape["rope_theta"], "attention_bias": False, "tie_word_embeddings": False,
           "initializer_range": WEIGHT_STD, "bos_token_id": ids[BOS], "eos_token_id": ids[EOS],
           "use_cache": True}
    if shape["arch"] == "qwen3_moe":
        cfg.update(architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=shape["moe_intermediate"],
                   num_experts=shape["experts"], num_experts_per_tok=shape["experts_per_tok"],
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
                   router_aux_loss_coef=0.001, sliding_window=None, use_sliding_window=False, max_window_layers=shape["layers"],
                   attention_dropout=0.0)
    else:
        cfg.update(architectures=["LlamaForCausalLM"], mlp_bias=False, pretraining_tp=1,
                   rope_scaling=shape.get("rope_scaling"), attention_dropout=0.0)
    if dtype == "fp8":
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
        if shape["arch"] == "qwen3_moe":
            q["modules_to_not_convert"] = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(shape["layers"])]
        cfg["quantization_config"] = q
    return cfg


def special_ids(vocab: int) -> dict[str, int]:
    return {t: vocab - len(SPECIALS) + i for i, t in enumerate(SPECIALS)}


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> one printable character (as tokenizers' ByteLevel)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json(vocab: int) -> dict:
    """A byte-level BPE whose vocabulary is exactly `vocab` entries: the 256 bytes, then merges of
    two bytes, then of a pair and a byte, in a fixed order, then the special tokens. Every id
    decodes to text (a random model's output is never an unknown id)."""
    alphabet = byte_alphabet()
    room = vocab - 256 - len(SPECIALS)
    if room < 0:
        raise ValueError(f"vocab {vocab} is too small for the byte alphabet and {len(SPECIALS)} special tokens")
    tokens, merges = list(alphabet), []
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in (*_take(pairs, room), *_take(triples, max(0, room - 256 * 256))):
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    vocab_map = {t: i for i, t in enumerate(tokens)}
    ids = special_ids(vocab)
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": ids[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t in SPECIALS],
        "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **dict(byte_level, trim_offsets=False)},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": dict(vocab_map, **ids), "merges": merges},
    }


def _take(it, n: int) -> list:
    out = []
    for item in it:
        if len(out) >= n:
            break
        out.append(item)
    return out


def tokenizer_files(vocab: int, max_positions: int) -> dict[str, dict]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json beside tokenizer.json."""
    ids = special_ids(vocab)
    return {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "bos_token": BOS,
            "eos_token": EOS, "pad_token": PAD, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": max_positions,
            "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                                   "normalized": False, "single_word": False} for t in SPECIALS}},
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
        "generation_config.json": {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]},
    }


def safetensors_header(specs: list) -> bytes:
    """The safetensors header of one shard (u64 length, JSON, padded to 8 bytes), tensors in order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, kind, dims in specs:
        size = nbytes((name, kind, dims))
        header[name] = {"dtype": SAFETENSORS_DTYPE[kind], "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


# ---- the weights (torch) ---------------------------------------------------------------------

class Pool:
    """POOL values of N(0, 1) drawn once on `device`; tensor k is a window of them at a seeded offset."""

    def __init__(self, torch, device: str, seed: int):
        self.torch = torch
        g = torch.Generator(device=device).manual_seed(seed)
        base = torch.randn(POOL, generator=g, device=device, dtype=torch.float32)
        self.by_kind = {"bf16": (base * WEIGHT_STD).to(torch.bfloat16),
                        "fp8": (base * FP8_GAIN).clamp_(-448, 448).to(torch.float8_e4m3fn)}
        self.ones = torch.ones(1, dtype=torch.bfloat16, device=device)
        self.offsets = torch.randint(0, POOL, (1 << 16,), generator=torch.Generator().manual_seed(seed + 1)).tolist()

    def tensor(self, index: int, name: str, kind: str, dims: list[int]):
        torch = self.torch
        n = math.prod(dims)
        if kind == "f32":  # block scales: dequantized weights come out N(0, 0.02)
            return torch.full((n,), WEIGHT_STD / FP8_GAIN, dtype=torch.float32)
        if name.endswith("norm.weight"):
            return self.ones.expand(n).cpu()
        pool = self.by_kind[kind]
        start = self.offsets[index % len(self.offsets)]
        reps = math.ceil((start + n) / POOL)
        flat = pool.repeat(reps)[start:start + n] if reps > 1 else pool[start:start + n]
        return flat.cpu()


def write(out: Path, shape: dict, dtype: str, device: str = "cpu", seed: int = 0, log=print) -> dict:
    """Write the checkpoint into `out` (created; files there are overwritten). Returns a summary."""
    import torch

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(shape, dtype)
    files = shards(specs)
    pool = Pool(torch, device, seed)
    weight_map, index = {}, 0
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tmp = out / f".{fname}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(safetensors_header(part))
                for name, kind, dims in part:
                    t = pool.tensor(index, name, kind, dims)
                    index += 1
                    fh.write(t.contiguous().view(torch.uint8).numpy().data)
                    weight_map[name] = fname
            os.replace(tmp, out / fname)
        finally:  # a write that failed (the disk filled after the check, Ctrl-C) leaves no multi-GB scratch
            tmp.unlink(missing_ok=True)
        log(f"{fname}: {len(part)} tensors, {sum(map(nbytes, part)) / 1e9:.2f} GB ({time.monotonic() - t0:.1f} s)")
    total = sum(map(nbytes, specs))
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", config(shape, dtype))
    _write_json(out / "tokenizer.json", tokenizer_json(shape["vocab"]))
    for name, obj in tokenizer_files(shape["vocab"], shape["max_positions"]).items():
        _write_json(out / name, obj)
    params = sum(math.prod(d) for n, k, d in specs if k != "f32")
    return {"out": str(out), "shape": shape["name"], "dtype": dtype, "layers": shape["layers"], "params": params,
            "bytes": total, "files": len(files), "seconds": round(time.monotonic() - t0, 1), "device": device}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def room_for(out: Path, total: int, spare: int = 1 << 30) -> None:
    """ValueError unless `out` is (or can be) a directory whose filesystem has the checkpoint's
    bytes free, with `spare` left: a checkpoint that fills the disk stops the host's other work."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is not a directory")
    where = out
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if total + spare > free:
        raise ValueError(f"{out}: the checkpoint is {total / 1e9:.1f} GB and its filesystem has {free / 1e9:.1f} GB "
                         f"free (1 GB kept spare); free space, pick another OUT or fewer --layers")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m servops.lab.modelgen",
                                 description="Write a random-weight checkpoint at a real model's shape.")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--layers", type=int, default=None, help="the shape's depth changed to N layers")
    ap.add_argument("--device", default=None, help="where the pool is drawn (default: cuda when torch sees one)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        shape = shape_of(a.shape, a.layers)
        room_for(a.out, sum(map(nbytes, tensor_specs(shape, a.dtype))))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    summary = write(a.out, shape, a.dtype, device=device, seed=a.seed)
    print(f"{a.out}: {summary['shape']} ({summary['layers']} layers), {a.dtype}, {summary['params'] / 1e6:,.1f} M "
          f"parameters, {summary['bytes'] / 1e9:.2f} GB in {summary['files']} file(s), {summary['seconds']} s on "
          f"{device}; random weights: speed only, the text is noise")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
