"""The serve benchmark's model folders: the word-level tokenizer round-trips
text (also through vLLM's random dataset and streaming decoder), the configs
load in transformers' and vLLM's config classes, and the memory estimate's
parameter counts agree with transformers' own DeepSeek-V3.2 model built on
the meta device."""

import importlib.util
import json
import math
import os
import random

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serve_model.py")
_spec = importlib.util.spec_from_file_location("serve_model", _PATH)
sm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sm)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def proxy_dir(tmp_path_factory):
    return sm.write_model(str(tmp_path_factory.mktemp("proxy")), sm.model_config("proxy", layers=3))


def _fast_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_words_are_distinct_letters_and_the_vocabulary_places_the_specials():
    words = [sm.word(i) for i in range(20000)]
    assert len(set(words)) == len(words) and all(w.isalpha() and w.islower() for w in words)
    rng = random.Random(5)
    for _ in range(20):
        size = rng.randrange(8, 5000)
        bos, eos = rng.sample(range(min(size, 6)), 2)
        vocab = sm.vocabulary(size, bos, eos)
        assert sorted(vocab.values()) == list(range(size))
        assert vocab["<s>"] == bos and vocab["</s>"] == eos and vocab[sm.UNK] < 3
    with pytest.raises(ValueError, match="bos_id"):
        sm.vocabulary(100, 1, 1)
    with pytest.raises(ValueError, match="i:"):
        sm.word(-1)


@pytest.mark.parametrize("name", ["tiny", "proxy"])
def test_random_ids_text_round_trips_through_the_saved_tokenizer(tmp_path, name):
    cfg = sm.model_config(name, layers=2)
    tok = _fast_tokenizer(sm.write_model(str(tmp_path / name), cfg))
    assert tok.vocab_size == len(tok) == cfg["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert tok.num_special_tokens_to_add() == 0  # a prompt's length is its word count
    rng = random.Random(name)
    specials = set(tok.all_special_ids)
    for _ in range(20):
        ids = [rng.randrange(cfg["vocab_size"]) for _ in range(rng.randrange(1, 400))]
        ids = [i for i in ids if i not in specials] or [5]
        text = tok.decode(ids)
        assert tok.encode(text, add_special_tokens=False) == ids
        assert len(text.split()) == len(ids)


def test_the_streaming_decoder_gives_the_same_text_as_a_whole_decode(proxy_dir):
    """vLLM streams a fast tokenizer's text with tokenizers' DecodeStream:
    its pieces joined are the whole decode, so texts compare as token ids do."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer.from_file(os.path.join(proxy_dir, "tokenizer.json"))
    rng = random.Random(9)
    for _ in range(10):
        ids = [rng.randrange(3, 16384) for _ in range(rng.randrange(1, 200))]
        stream = DecodeStream(skip_special_tokens=True)
        pieces = [stream.step(tok, i) for i in ids]
        assert "".join(p for p in pieces if p) == tok.decode(ids)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_vllm_random_dataset_gets_prompts_of_the_asked_length(proxy_dir):
    """`vllm bench serve --dataset-name random` samples ids, decodes and
    re-encodes them: with this tokenizer every prompt has its sampled length."""
    from vllm.benchmarks.datasets import RandomDataset

    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # vLLM 0.27's location
        from vllm.transformers_utils.tokenizer import get_tokenizer
    tok = get_tokenizer(proxy_dir)
    seed = random.randrange(1000)
    reqs = RandomDataset(random_seed=seed).sample(tokenizer=tok, num_requests=6, input_len=900,
                                                  output_len=16, range_ratio=0.3)
    assert len(reqs) == 6
    for r in reqs:
        assert 630 <= r.prompt_len <= 1170
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
@pytest.mark.parametrize("name,mlp", [("tiny", "dense"), ("proxy", "dense"), ("proxy", "moe")])
def test_vllm_reads_the_configs_as_written(tmp_path, name, mlp):
    from vllm.transformers_utils.config import get_config

    cfg = sm.model_config(name, layers=5, mlp=mlp)
    got = get_config(sm.write_model(str(tmp_path / name), cfg), trust_remote_code=False)
    for key in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "num_attention_heads", "num_hidden_layers", "num_nextn_predict_layers",
                "index_n_heads", "index_head_dim", "index_topk", "intermediate_size",
                "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size", "vocab_size"):
        assert getattr(got, key) == cfg[key], key


def test_the_rank_proxy_has_deepseek_v32s_widths_and_one_tp8_ranks_share():
    cfg = sm.model_config("proxy")
    assert (cfg["hidden_size"], cfg["q_lora_rank"], cfg["kv_lora_rank"],
            cfg["qk_rope_head_dim"]) == (7168, 1536, 512, 64)
    assert (cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]) == (61, 1)
    assert cfg["num_attention_heads"] == 128 // 8
    assert (cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]) == (64, 128, 2048)
    # every MLP dense (vLLM numbers the MTP layer num_hidden_layers), of one routed
    # expert's and the shared expert's width
    assert cfg["first_k_dense_replace"] > cfg["num_hidden_layers"]
    assert cfg["intermediate_size"] == cfg["moe_intermediate_size"] * (
        cfg["num_experts_per_tok"] + cfg["n_shared_experts"])
    assert cfg["vocab_size"] * 8 >= 129280
    fp8 = sm.model_config("proxy", weights="fp8")["quantization_config"]
    assert fp8["quant_method"] == "fp8" and fp8["weight_block_size"] == [128, 128]
    for bad in ({"name": "big"}, {"mlp": "sparse"}, {"weights": "int4"}, {"layers": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            sm.model_config(**bad)


def _hf_params(cfg: dict):
    import transformers

    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")}
    with torch.device("meta"):
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**keep))
    # the router's score-correction bias is a buffer there, a parameter in vLLM
    return list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]


@pytest.mark.parametrize("name,mlp,layers", [("tiny", "dense", 3), ("proxy", "dense", 2),
                                             ("proxy", "moe", 4)])
def test_parameter_counts_match_transformers_deepseek_v32(name, mlp, layers):
    """The estimate's target-model parameters equal the count of transformers'
    DeepSeek-V3.2 model (indexer included) built from the same config; its
    fp8 bytes equal a per-matrix count with 128 x 128 block scales."""
    cfg = sm.model_config(name, layers=layers, mlp=mlp)
    hf = _hf_params(cfg)
    est = sm.memory_estimate(dict(cfg, num_nextn_predict_layers=0))
    assert est["params"]["mtp"] == 0
    assert est["params"]["model"] == sum(p.numel() for _, p in hf)
    fp8 = 0
    for n, p in hf:
        quantized = (".layers." in n and p.dim() >= 2 and "weights_proj" not in n
                     and not n.endswith("mlp.gate.weight"))
        if quantized:
            rows, cols = p.shape[-2:]
            blocks = math.ceil(rows / 128) * math.ceil(cols / 128) * (p.numel() // (rows * cols))
            fp8 += p.numel() + 4 * blocks
        else:
            fp8 += 2 * p.numel()
    assert est["weights_gib"]["fp8"] * (1 << 30) == pytest.approx(fp8, rel=2e-3)
    assert est["weights_gib"]["bf16"] * (1 << 30) == 2 * est["params"]["total"]


def test_kv_bytes_and_what_fits():
    cfg = sm.model_config("proxy")
    layers = 62
    assert sm.kv_bytes_per_token(cfg)["total"] == layers * (2 * 576 + 132)
    assert sm.kv_bytes_per_token(cfg, "fp8_ds_mla")["total"] == layers * (656 + 132)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        sm.kv_bytes_per_token(cfg, "fp8")
    est = sm.memory_estimate(cfg, reserve_gib=6.0)
    for gpu, mib in sm.GPUS_MIB.items():
        for w in ("bf16", "fp8"):
            left = mib * 2**20 * 0.9 - 6 * 2**30 - est["weights_gib"][w] * 2**30
            got = est["fits"][gpu][w]["kv_tokens"]
            assert got * est["kv_bytes_per_token"]["total"] <= left
            assert (got + 1) * est["kv_bytes_per_token"]["total"] > left
    # the dense proxy fits both cards with room for KV; the real rank's 32 experts only the H200, fp8
    assert est["fits"]["H100 80GB"]["bf16"]["requests_at_context"] >= 16
    moe = sm.memory_estimate(sm.model_config("proxy", mlp="moe"))
    assert moe["fits"]["H100 80GB"]["fp8"]["kv_tokens"] == 0
    assert moe["fits"]["H200 141GB"]["fp8"]["kv_tokens"] > 0
    assert moe["params"]["mlp_read_per_token_per_layer_max"] == pytest.approx(
        est["params"]["mlp_per_layer_max"], rel=0.01)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        sm.memory_estimate(cfg, gpu_memory_utilization=1.5)
