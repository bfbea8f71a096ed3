"""A tiny random-weight Llama checkpoint that a real vLLM (or sglang) loads offline.

    python servops/lab/tinymodel.py OUT_DIR [--shape llama-h256|llama-hd16]

No model hub is reachable from the lab, so the model is made here: config.json,
generation_config.json, model.safetensors (seeded random bf16 weights), tokenizer.json (a
byte-level BPE trained by the `tokenizers` library on a corpus built into this file),
tokenizer_config.json with a chat template, special_tokens_map.json. About 3.5 MB, written in
under two seconds, byte-identical on every run with the same numpy and tokenizers releases
(`fingerprint()` names them, for cache keys).

Runs on any python that has numpy and tokenizers (the vLLM venv has both); it imports nothing
of servops, so the venv's python runs this file directly.

Shapes:
  llama-h256  hidden 256, 4 heads of 64 (2 KV heads): vLLM's CPU attention serves it.
  llama-hd16  the same model with 16 heads of 16 (4 KV heads): vLLM's CPU attention refuses
              head_dim 16, but only at the first request, after /health already answers 200.
  llama-h768  hidden 768, 12 heads of 64 (4 KV heads), 6 layers, ~40M parameters: slow enough
              per token on a CPU core that the server, not the benchmark client, sets the pace
              (bench/parity_vllm_bench.py, before llama-h1024).
  llama-h1024 hidden 1024, 16 heads of 64 (4 KV heads), 12 layers, ~150M parameters: ~4x the
              work per token of llama-h768, so that on 2 shared cores a decode step (~15 ms)
              dwarfs the scheduling delays of the processes beside the model (vLLM's busy
              EngineCore, its API server, the client): bench/parity_vllm_bench.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import sys
from pathlib import Path

SHAPES = {
    "llama-h256": {"hidden": 256, "heads": 4, "kv_heads": 2},
    "llama-hd16": {"hidden": 256, "heads": 16, "kv_heads": 4},
    "llama-h768": {"hidden": 768, "heads": 12, "kv_heads": 4, "layers": 6, "intermediate": 2048},
    "llama-h1024": {"hidden": 1024, "heads": 16, "kv_heads": 4, "layers": 12, "intermediate": 2816},
}
COMMON = {"layers": 2, "intermediate": 512, "vocab": 1024, "max_positions": 2048, "seed": 20240}

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, *ROLE_TOKENS]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The tokenizer's training text: sentences an inference operator writes, recombined below.
_SENTENCES = """\
The server answered the health check after the model finished loading.
A tuning campaign compares two variants of the launch flags at three concurrency levels.
Rollback restores the previous release when the new server fails its first request.
The scheduler keeps sixteen requests running and queues the rest until cache blocks free up.
Time to first token grows with the prompt length; inter-token latency grows with the batch.
Prefix caching reuses the key and value blocks of a shared system prompt.
The engine core process owns the scheduler; the worker process runs the forward pass.
Every flag is checked by the host's own parser before anything is stopped.
Metrics are scraped from the Prometheus endpoint once a second during the benchmark.
Tensor parallel size eight splits each layer across the eight GPUs of one host.
The compile cache lives on disk, so the second start skips most of the compilation.
Patches are applied per distribution, and each one is verified against its record.
"""
_EXTRA_WORDS = ("vllm sglang cuda torch triton flashinfer json yaml http https tcp port pid "
                "0 1 2 3 4 5 6 7 8 9 16 32 64 128 256 512 1024 2048 4096 8192 "
                "( ) [ ] { } < > = + - * / % _ , . : ; ! ? ' \" # @ $ & | ~ ^ ` \\").split()


def corpus(seed: int, lines: int = 4000):
    """The training text: the sentences above, then seeded shuffles of their words."""
    rng = random.Random(seed)
    sentences = _SENTENCES.splitlines()
    words = sorted(set(" ".join(sentences).split())) + _EXTRA_WORDS
    yield from sentences
    for _ in range(lines):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))
    yield "".join(chr(c) for c in range(32, 127))  # every printable ASCII character at least once


def train_tokenizer(vocab: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=1, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def bfloat16_bytes(values) -> bytes:
    """float32 array -> little-endian bfloat16, rounded to nearest even (numpy has no bf16)."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return rounded.astype("<u2").tobytes()


def write_safetensors(path: Path, tensors: dict) -> None:
    """The safetensors layout: u64 header length, JSON header, then the raw tensors in order."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        blob = bfloat16_bytes(tensors[name])
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for blob in blobs:
            fh.write(blob)


def llama_weights(shape: dict, vocab: int, seed: int) -> dict:
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    hidden, inter = shape["hidden"], shape["intermediate"]
    head_dim = hidden // shape["heads"]
    q_out, kv_out = shape["heads"] * head_dim, shape["kv_heads"] * head_dim

    def dense(rows, cols):
        return rng.normal(0.0, 0.02, size=(rows, cols)).astype(np.float32)

    ones = np.ones(hidden, np.float32)
    tensors = {"model.embed_tokens.weight": dense(vocab, hidden), "model.norm.weight": ones,
               "lm_head.weight": dense(vocab, hidden)}
    for layer in range(shape["layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones,
            p + "self_attn.q_proj.weight": dense(q_out, hidden), p + "self_attn.k_proj.weight": dense(kv_out, hidden),
            p + "self_attn.v_proj.weight": dense(kv_out, hidden), p + "self_attn.o_proj.weight": dense(hidden, q_out),
            p + "mlp.gate_proj.weight": dense(inter, hidden), p + "mlp.up_proj.weight": dense(inter, hidden),
            p + "mlp.down_proj.weight": dense(hidden, inter),
        })
    return tensors


def _json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def generate(out: Path, shape_name: str = "llama-h256") -> Path:
    """Write the model `shape_name` into `out` (created; files there are overwritten)."""
    shape = dict(COMMON, **SHAPES[shape_name])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape["vocab"], shape["seed"])
    # a small corpus can run out of merges before the vocabulary is full: pad with plain tokens
    # so every id the model can emit decodes to text
    missing = shape["vocab"] - tokenizer.get_vocab_size()
    if missing > 0:
        from tokenizers import AddedToken
        tokenizer.add_tokens([AddedToken(f"<filler{k}>", normalized=False) for k in range(missing)])
    tokenizer.save(str(out / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    head_dim = shape["hidden"] // shape["heads"]
    _json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": vocab, "hidden_size": shape["hidden"], "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"], "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": shape["max_positions"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD], "use_cache": True,
    })
    _json(out / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS],
                                           "pad_token_id": ids[PAD]})
    _json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                                            "unk_token": UNK})
    _json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": shape["max_positions"],
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False}
                                 for t in SPECIAL_TOKENS},
    })
    write_safetensors(out / "model.safetensors", llama_weights(shape, vocab, shape["seed"]))
    return out


def fingerprint() -> str:
    """What the generated bytes depend on: this file and the numpy/tokenizers releases."""
    import numpy
    import tokenizers

    blob = Path(__file__).read_bytes() + f"|{numpy.__version__}|{tokenizers.__version__}".encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write a tiny random-weight Llama checkpoint (offline).")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-h256")
    a = ap.parse_args(argv)
    generate(a.out, a.shape)
    size = sum(f.stat().st_size for f in a.out.iterdir())
    print(f"{a.out}: {a.shape}, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
