#!/usr/bin/env python3
"""Model folders for ``benchmarks/serve.py``: a DeepSeek-V3.2 architecture
``config.json`` (dummy weights) plus a word-level tokenizer, so that
``vllm serve`` loads it and ``vllm bench serve``'s random dataset, which
samples token ids and decodes them to text, gets its prompts back at the
length it asked for.

    python3 benchmarks/serve_model.py --out /tmp/proxy --config proxy     # write one
    python3 benchmarks/serve_model.py --estimate                          # memory, both configs

Two configs:

* ``tiny`` -- the project's default engine model (``e2e_decode.TINY_CONFIG``):
  the real indexer and MLA ranks, hidden 1024, 64 heads, dense 2048 MLPs,
  vocab 4096.  Every per-layer cost outside the indexer is small, so it
  inflates an indexer gain.
* ``proxy`` -- a **rank proxy**: what one rank of DeepSeek-V3.2 served at TP8
  (attention) / EP8 (experts) computes per token.  DeepSeek-V3.2's widths
  (hidden 7168, q_lora 1536, kv_lora 512, rope 64, 61 layers + 1 MTP
  layer), 16 attention heads (128 / 8), the full indexer (64 x 128, top-k
  2048: vLLM runs it unsharded on every TP rank), a vocabulary of 16384 (a
  TP8 share of 129280, rounded).  The MLP: by default dense, intermediate
  4096 in every layer (the FLOPs of one routed expert of 2048 -- top-1 of
  the rank's 32, a token's 8 experts being spread over 8 ranks -- plus the
  shared expert of 2048); ``--mlp moe`` writes the MoE form instead (32
  routed experts of 2048, top-1, a shared expert, the real first three
  dense layers at their TP8 share 2304), for a vLLM where MoE with dummy
  weights loads.  ``--weights fp8`` adds DeepSeek-V3.2's block-fp8
  ``quantization_config``.

What the dense proxy cuts from the real rank (:func:`memory_estimate` counts
both): the other 31 routed experts' weights (~1.3 G parameters a layer), the
router, and the all-to-all / all-reduce traffic of EP8 / TP8; the MLP's
FLOPs per token are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_decode import TINY_CONFIG  # noqa: E402

# The dense rank proxy (module docstring).  first_k_dense_replace past every
# layer, the MTP layer included (vLLM numbers it num_hidden_layers), makes
# every MLP dense; the MoE fields describe the rank it stands for.
RANK_PROXY_CONFIG = dict(
    TINY_CONFIG, hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, num_attention_heads=16, num_key_value_heads=16,
    num_hidden_layers=61, num_nextn_predict_layers=1, index_n_heads=64, index_head_dim=128,
    index_topk=2048, intermediate_size=4096, first_k_dense_replace=1000, n_routed_experts=32,
    num_experts_per_tok=1, moe_intermediate_size=2048, n_shared_experts=1, vocab_size=16384,
    n_group=1, topk_group=1)
# The MoE form: DeepSeek-V3.2's three dense layers at a TP8 share of their 18432.
RANK_PROXY_MOE = dict(RANK_PROXY_CONFIG, first_k_dense_replace=3, intermediate_size=2304)
# DeepSeek-V3.2's checkpoint quantization (block-wise fp8 weights).
FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128]}
# tiny at the engine benchmark's default depth (DeepSeek-V3.2's 61 layers)
CONFIGS = {"tiny": dict(TINY_CONFIG, num_hidden_layers=61), "proxy": RANK_PROXY_CONFIG}

UNK = "<unk>"
# GPU memory (MiB) as the cards report it: an 80 GB H100, a 141 GB H200.
GPUS_MIB = {"H100 80GB": 81559, "H200 141GB": 143771}


def model_config(name: str = "proxy", *, layers: int | None = None, mlp: str = "dense",
                 weights: str = "bf16") -> dict:
    """The ``config.json`` of ``name`` (:data:`CONFIGS`), with ``layers``
    decoder layers when given; ``mlp`` / ``weights`` as the module says."""
    if name not in CONFIGS:
        raise ValueError(f"name: expected one of {', '.join(CONFIGS)}, got {name!r}")
    if mlp not in ("dense", "moe"):
        raise ValueError(f"mlp: expected 'dense' or 'moe', got {mlp!r}")
    if weights not in ("bf16", "fp8"):
        raise ValueError(f"weights: expected 'bf16' or 'fp8', got {weights!r}")
    if mlp == "moe" and name != "proxy":
        raise ValueError("mlp: 'moe' is a form of the rank proxy only")
    if layers is not None and layers < 1:
        raise ValueError(f"layers: expected >= 1, got {layers}")
    cfg = dict(RANK_PROXY_MOE if mlp == "moe" else CONFIGS[name])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if weights == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANTIZATION)
    return cfg


def word(i: int) -> str:
    """Token ``i``'s word: distinct lowercase letters for every id (bijective
    base 26), so a whitespace split of decoded text gives the ids back."""
    if i < 0:
        raise ValueError(f"i: expected >= 0, got {i}")
    out = []
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        out.append(chr(ord("a") + r))
    return "".join(reversed(out))


def vocabulary(vocab_size: int, bos_id: int, eos_id: int) -> dict[str, int]:
    """Word -> id for every id below ``vocab_size``: ``<s>`` / ``</s>`` at the
    config's bos / eos ids, ``<unk>`` at the lowest other id, :func:`word`
    elsewhere."""
    if bos_id == eos_id or not (0 <= bos_id < vocab_size and 0 <= eos_id < vocab_size):
        raise ValueError(f"bos_id / eos_id: expected two different ids below {vocab_size}, "
                         f"got {bos_id} / {eos_id}")
    unk_id = min(set(range(3)) - {bos_id, eos_id})
    special = {bos_id: "<s>", eos_id: "</s>", unk_id: UNK}
    return {special.get(i, word(i)): i for i in range(vocab_size)}


def write_tokenizer(path: str, vocab_size: int, bos_id: int, eos_id: int,
                    max_length: int) -> None:
    """``tokenizer.json`` (WordLevel, whitespace split, no decoder: ids decode
    to their words joined by spaces), ``tokenizer_config.json`` and
    ``special_tokens_map.json`` into ``path``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = vocabulary(vocab_size, bos_id, eos_id)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", UNK)])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": UNK}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                   "clean_up_tokenization_spaces": False, **specials}, f, indent=1)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump(specials, f, indent=1)


def write_model(path: str, cfg: dict) -> str:
    """A model folder vLLM serves with dummy weights: ``cfg`` as
    ``config.json``, its ``generation_config.json`` (bos / eos only) and the
    word-level tokenizer over its vocabulary."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f)
    write_tokenizer(path, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"],
                    cfg["max_position_embeddings"])
    return path


# ----------------------------------------------------------------------------- memory

def _attention_params(cfg: dict) -> dict[str, int]:
    """One layer's attention parameters by matrix (MLA + the indexer), norms included."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora, kv_lora, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    return {
        "q_a_proj": h * q_lora, "q_b_proj": q_lora * heads * (nope + rope),
        "kv_a_proj_with_mqa": h * (kv_lora + rope), "kv_b_proj": kv_lora * heads * (nope + v),
        "o_proj": heads * v * h, "indexer.wq_b": q_lora * ih * idim, "indexer.wk": h * idim,
        "indexer.weights_proj": h * ih, "norms": q_lora + kv_lora + 2 * idim + 2 * h,
    }


def _mlp_params(cfg: dict, layer: int) -> tuple[int, int, int]:
    """One layer's MLP: (its matrices' parameters, those a token's product
    reads, the router's parameters: 0 for a dense MLP)."""
    h = cfg["hidden_size"]
    if layer < cfg["first_k_dense_replace"] or not cfg.get("n_routed_experts"):
        n = 3 * h * cfg["intermediate_size"]
        return n, n, 0
    expert = 3 * h * cfg["moe_intermediate_size"]
    shared = cfg.get("n_shared_experts") or 0
    gate = h * cfg["n_routed_experts"] + cfg["n_routed_experts"]  # router and its bias
    return (expert * (cfg["n_routed_experts"] + shared),
            expert * (cfg["num_experts_per_tok"] + shared), gate)


def kv_bytes_per_token(cfg: dict, kv_cache_dtype: str = "auto") -> dict[str, int]:
    """KV-cache bytes one token takes in every layer (the MTP layer's too):
    the MLA latent (``auto``: bf16; ``fp8_ds_mla``: 512 fp8 + 4 fp32 scales +
    64 bf16 RoPE values) and the indexer's key (fp8 + one fp32 scale per 128)."""
    layers = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    if kv_cache_dtype == "auto":
        mla = 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    elif kv_cache_dtype == "fp8_ds_mla":
        mla = cfg["kv_lora_rank"] + 4 * (cfg["kv_lora_rank"] // 128) + 2 * cfg["qk_rope_head_dim"]
    else:
        raise ValueError(f"kv_cache_dtype: expected 'auto' or 'fp8_ds_mla', got {kv_cache_dtype!r}")
    index = cfg["index_head_dim"] + 4 * (cfg["index_head_dim"] // 128)
    return {"mla": mla * layers, "indexer": index * layers, "total": (mla + index) * layers}


def memory_estimate(cfg: dict, *, kv_cache_dtype: str = "auto",
                    gpu_memory_utilization: float = 0.9, reserve_gib: float = 8.0,
                    context: int = 16384 + 128) -> dict:
    """Parameters, weight bytes (bf16, and block-fp8: 1 byte + a 4-byte
    scale per 128 x 128 block for the layers' matrices, bf16 elsewhere), KV
    bytes per token, and per GPU of :data:`GPUS_MIB` the KV tokens left at
    ``gpu_memory_utilization`` after the weights and ``reserve_gib`` for
    activations and CUDA graphs (an assumption, not measured), with the
    requests of ``context`` tokens that fit at once.  The MTP layer has its
    own embedding and head here (an upper bound: vLLM may share them)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: expected in (0, 1], got {gpu_memory_utilization}")
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    layers = cfg["num_hidden_layers"]
    mtp = cfg.get("num_nextn_predict_layers", 0)
    attn = _attention_params(cfg)
    attn_all = sum(attn.values())
    attn_fp8 = attn_all - attn["norms"] - attn["indexer.weights_proj"]  # as the checkpoint
    mlps = [_mlp_params(cfg, i) for i in range(layers + mtp)]
    matrices = sum(attn_fp8 + m for m, _, _ in mlps)
    layer_params = [attn_all + m + g for m, _, g in mlps]
    embed_head = 2 * vocab * h
    mtp_extra = mtp * (2 * h * h + 3 * h + embed_head)  # eh_proj, 3 norms, embed + head
    idim = cfg["index_head_dim"]
    params = {
        "attention_per_layer": attn_all,
        "indexer_per_layer": (attn["indexer.wq_b"] + attn["indexer.wk"]
                              + attn["indexer.weights_proj"] + 2 * idim),
        "mlp_per_layer_max": max(m + g for m, _, g in mlps),
        "mlp_read_per_token_per_layer_max": max(r for _, r, _ in mlps),
        "model": sum(layer_params[:layers]) + embed_head + h,  # + the final norm
        "mtp": sum(layer_params[layers:]) + mtp_extra,
    }
    params["total"] = params["model"] + params["mtp"]
    bf16 = 2 * params["total"]
    fp8 = bf16 - 2 * matrices + matrices * (1 + 4 / (128 * 128))
    kv = kv_bytes_per_token(cfg, kv_cache_dtype)
    gib = 1 << 30
    fits = {}
    for gpu, mib in GPUS_MIB.items():
        budget = mib * (1 << 20) * gpu_memory_utilization - reserve_gib * gib
        fits[gpu] = {}
        for name, weights in (("bf16", bf16), ("fp8", fp8)):
            tokens = int(max(0, budget - weights) // kv["total"])
            fits[gpu][name] = {"kv_tokens": tokens, "requests_at_context": tokens // context}
    return {"params": params, "weights_gib": {"bf16": bf16 / gib, "fp8": fp8 / gib},
            "kv_bytes_per_token": kv, "kv_cache_dtype": kv_cache_dtype,
            "gpu_memory_utilization": gpu_memory_utilization, "reserve_gib": reserve_gib,
            "context": context, "fits": fits}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the model folder here")
    ap.add_argument("--config", default="proxy", choices=list(CONFIGS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--mlp", default="dense", choices=["dense", "moe"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--estimate", action="store_true", help="print the memory estimates")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_ds_mla"])
    args = ap.parse_args(argv)
    if args.out:
        cfg = model_config(args.config, layers=args.layers, mlp=args.mlp, weights=args.weights)
        print(write_model(args.out, cfg))
    if args.estimate or not args.out:
        for name, mlp in (("tiny", "dense"), ("proxy", "dense"), ("proxy", "moe")):
            cfg = model_config(name, layers=args.layers, mlp=mlp)
            print(f"{name} ({mlp}): {json.dumps(memory_estimate(cfg, kv_cache_dtype=args.kv_cache_dtype), indent=1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
