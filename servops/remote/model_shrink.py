# model_shrink: a model's config.json read bounded, and shrunk to the fewest layers that keep every
# layer kind (dense and MoE MLPs, attention types, RoPE or not), for the audit's side server (its
# weights are dummy: only the config and the tokenizer files travel), and the GPU memory that server
# needs (the shrunk weights read from the checkpoint's safetensors headers). Standard library only: a
# library of audit_compile.py, importable as servops.remote.model_shrink for tests.
import json
import math
import os
import re
import struct

MAX_CONFIG_BYTES = 4 << 20        # a model's config.json: a real one is a few kB
MAX_LAYERS = 4096                 # the deepest real models have a few hundred; past this a count is a lie
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MAX_SHARDS = 4096                 # safetensors files read for the weights' size
MAX_HEADER_BYTES = 64 << 20       # one safetensors header (a real one is a few MB at most)


def read_config(model_path):
    """The model's config.json, bounded: a regular file of at most MAX_CONFIG_BYTES."""
    import stat as stat_mod
    path = os.path.join(os.path.expanduser(model_path), "config.json")  # ~/ as the launch check reads it
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        return None, "cannot open %s: %s" % (path, exc.strerror)
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            return None, "%s is not a regular file" % path
        if st.st_size > MAX_CONFIG_BYTES:
            return None, "%s is %d bytes (a config.json is a few kB; at most %d read)" % (
                path, st.st_size, MAX_CONFIG_BYTES)
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    try:
        config = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return None, "%s is not JSON: %s" % (path, str(exc)[:200])
    except RecursionError:  # arrays or objects nested past the parser's depth: no config is
        return None, "%s is not a model config: JSON nested too deep" % path
    if not isinstance(config, dict):
        return None, "%s is not a JSON object" % path
    return config, None


# ---- the fewest layers that keep every layer kind ----------------------------------------------

def _int(value, default=0):
    """An integer from a config value; `default` for anything else (text, inf, NaN, 1e400, a list)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return default


def _layer_list(value):
    """A config's list of layer indices (mlp_only_layers); anything else is no list."""
    return [i for i in value if isinstance(i, int) and not isinstance(i, bool)] if isinstance(value, list) else []


def layer_count_problem(value):
    """Why a layer count is not one a real model has (None: it is): a positive integer up to MAX_LAYERS."""
    whole = isinstance(value, int) or (isinstance(value, str) and value.isdigit()) or (
        isinstance(value, float) and value == value and abs(value) != float("inf") and value.is_integer())
    if isinstance(value, bool) or not whole:
        return "%r is not a whole number" % (value,)
    if not 0 < int(value) <= MAX_LAYERS:
        return "%s is not a layer count a model has (1 to %d)" % (str(value)[:40], MAX_LAYERS)
    return None


def layer_kind(config, i, n):
    """What makes layer i of this config differ from another (dense or MoE MLP, attention type,
    RoPE or not), from the config's own per-layer rules and per-layer lists."""
    return _layer_kind(_per_layer(config, n), i)


RULE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "mlp_only_layers",
             "first_k_dense_replace", "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq",
             "full_attention_interval", "sliding_window_pattern")


def _per_layer(config, n):
    """The part of a config that tells layers apart, taken once: its per-layer lists and pattern
    strings and the rule keys (a 4 MB config of 150,000 keys was walked once per layer: minutes)."""
    view = {key: value for key, value in config.items()
            if (isinstance(value, list) and len(value) == n and key != "architectures")
            or (isinstance(value, str) and len(value) == n and n > 1 and key.endswith("pattern"))}
    rules = {key: config[key] for key in RULE_KEYS if key in config}
    rules["mlp_only_layers"] = set(_layer_list(config.get("mlp_only_layers")))
    return sorted(view.items()), rules


def _layer_kind(per_layer, i):
    fields, config = per_layer
    kind = []
    for key, value in fields:
        if isinstance(value, list):
            kind.append((key, json.dumps(value[i], sort_keys=True)))
        else:
            kind.append((key, value[i]))  # Nemotron-H's hybrid_override_pattern: one character a layer
    experts = _int(config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts")
                   or config.get("moe_num_experts"))
    if experts:
        dense = i in config["mlp_only_layers"]
        first_k = config.get("first_k_dense_replace")
        if first_k is not None and i < _int(first_k):
            dense = True
        step = _int(config.get("decoder_sparse_step") or config.get("interleave_moe_layer_step") or 0)
        if step > 1 and (i + 1) % step != 0:
            dense = True
        freq = _int(config.get("moe_layer_freq") or 0)
        if freq > 1 and i % freq != 0:
            dense = True
        kind.append(("mlp", "dense" if dense else "moe"))
    for key in ("full_attention_interval", "sliding_window_pattern"):
        every = _int(config.get(key) or 0)
        if every > 1:
            kind.append((key, (i + 1) % every == 0))
    return tuple(kind)


def shrink_config(config):
    """(shrunk config, what was kept): the shortest prefix of the layers holding every kind."""
    text_key = "text_config" if isinstance(config.get("text_config"), dict) and \
        "num_hidden_layers" in config["text_config"] else None
    target = dict(config[text_key]) if text_key else dict(config)
    key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if target.get(k) is not None), None)
    if key is None:
        return None, "the config names no layer count (num_hidden_layers)"
    problem = layer_count_problem(target[key])
    if problem:  # before a list of kinds as long as it says (10^9 layers would fill the host's memory)
        return None, "the config's %s: %s" % (key, problem)
    n = _int(target[key])
    if _int(target.get("first_k_dense_replace")) > 1:  # DeepSeek/GLM: one dense layer is a dense layer
        target["first_k_dense_replace"] = 1
    per_layer = _per_layer(target, n)
    kinds = [_layer_kind(per_layer, i) for i in range(n)]
    wanted = set(kinds)
    keep, seen = n, set()
    for i, kind in enumerate(kinds):
        seen.add(kind)
        if seen == wanted:
            keep = i + 1
            break
    for k, value in list(target.items()):
        if isinstance(value, list) and len(value) == n and k != "architectures":
            target[k] = value[:keep]
        elif isinstance(value, str) and len(value) == n and n > 1 and k.endswith("pattern"):
            target[k] = value[:keep]
    if isinstance(target.get("mlp_only_layers"), list):
        target["mlp_only_layers"] = [i for i in _layer_list(target["mlp_only_layers"]) if i < keep]
    target[key] = keep
    out = dict(config)
    if text_key:
        out[text_key] = target
    else:
        out = target
    return out, {"layers": n, "kept": keep, "kinds": len(wanted)}


def shrunk_model(model_path, config, work):
    """A model directory: the shrunk config.json, every other file of the host's model that is
    not weights linked (tokenizer, generation and quantization configs)."""
    shrunk, info = shrink_config(config)
    if shrunk is None:
        return None, info
    out = os.path.join(work, "model")
    os.mkdir(out, 0o700)
    model_path = os.path.expanduser(model_path)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(shrunk, f, indent=1)
    for name in sorted(os.listdir(model_path))[:1000]:
        src = os.path.join(model_path, name)
        if name == "config.json" or name in WEIGHT_INDEXES or name.endswith(WEIGHT_SUFFIXES) or name.startswith("."):
            continue
        if os.path.isfile(src):
            os.symlink(src, os.path.join(out, name))
    return out, info


# ---- how much the shrunk model's weights take ------------------------------------------------------

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def _layer_of(name):
    """The decoder layer a tensor belongs to (None: embeddings, norms, the head, a vision tower)."""
    if "vision" in name or "visual" in name:
        return None
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def _safetensors_header(path):
    """{tensor: entry} of one safetensors file, bounded; None where it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            size = struct.unpack("<Q", head)[0]
            if not 2 <= size <= MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return header if isinstance(header, dict) else None


def shrunk_weight_bytes(model_path, kept):
    """The bytes of the weights the shrunk model (its first `kept` layers) holds, from the
    checkpoint's safetensors headers (dummy weights take what real ones would); None where the
    checkpoint has none to read."""
    model_path = os.path.expanduser(model_path)
    try:
        names = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))[:MAX_SHARDS]
    except OSError:
        return None
    total, read = 0, 0
    for name in names:
        header = _safetensors_header(os.path.join(model_path, name))
        if header is None:
            continue
        read += 1
        for tensor, entry in header.items():
            if tensor == "__metadata__" or not isinstance(entry, dict):
                continue
            offsets = entry.get("data_offsets")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
                continue
            layer = _layer_of(tensor)
            if layer is None or layer < kept:
                total += max(0, offsets[1] - offsets[0])
    return total if read else None


# ---- the audit server's memory ------------------------------------------------------------------

KV_RESERVE_MIB = 2048             # the audit's KV cache: past its largest capture size for a few layers
CONTEXT_MIB = 1024                # what the engine's CUDA context takes before it measures the free memory


def audit_memory(gpus, fraction, overhead_mib, mem_of, weights_mib):
    """The audit server's memory flag, sized for the GPUs as they are now: its budget is the larger
    of `fraction` of a GPU and the shrunk model's weights plus a KV reserve; an engine whose flag is
    a share of the memory free at its start ("free": sglang) gets that budget over what is free (a
    fixed share beside a serving server leaves the weights no room), one whose flag is a share of
    the whole GPU ("total": vLLM) over the total. {value, need_mib, short: GPUs with too little}."""
    total = min(g["total_mib"] for g in gpus)
    free = min(g["free_mib"] for g in gpus)
    budget = max(fraction * total, (weights_mib or 0) + KV_RESERVE_MIB)
    need = int(budget) + overhead_mib
    short = [g for g in gpus if g["free_mib"] < need]
    base = free - CONTEXT_MIB if mem_of == "free" else total
    share = min(0.95, budget / base) if base > 0 else 0.95
    return {"value": "%.3f" % (math.ceil(share * 1000) / 1000), "need_mib": need, "short": short}
