"""The peers in `saguaro bench`, on the same target, prompts and threads: Hugging Face
transformers `generate`, plain and with the same draft as `assistant_model` (assisted
generation), and llama.cpp (llama-cpp-python) decoding the same GGUF file token by token."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from saguaro.engine.sampler import SamplingParams
from saguaro.models.llama import LlamaModel


class Clock:
    """A transformers streamer that records when each step's tokens arrive and how many there
    are (the first call carries the prompt; assisted generation delivers a round at a time)."""

    def __init__(self):
        self.arrivals: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.arrivals.append((time.perf_counter(), value.shape[-1]))

    def end(self) -> None:
        pass


class ReducedHead(nn.Module):
    """A saguaro draft's reduced head as a transformers module: full-vocabulary logits, -inf
    outside the draft's tokens, so assisted generation proposes from the same distribution."""

    def __init__(self, draft: LlamaModel):
        super().__init__()
        self.weight = nn.Parameter(draft.lm_head.weight.detach().contiguous(), requires_grad=False)
        self.register_buffer("token_ids", draft.head_token_ids.clone())
        self.vocab_size = draft.config.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden, self.weight)
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_ids, logits)


def load_target(path: Path, dtype: torch.dtype):
    """The target as transformers loads it: a GGUF file or a Hugging Face folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes on GGUF casts and on generate's arguments are noise here
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval().requires_grad_(False)


def as_transformers(draft: LlamaModel):
    """A saguaro draft as a transformers `LlamaForCausalLM` with the same weights (q/k/v and
    gate/up unfused), for use as `assistant_model`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if draft.reads_features:
        raise ValueError("an EAGLE draft reads the target's hidden states: transformers cannot run it as an assistant")
    c = draft.config
    if not c.llama_like:  # Gemma's norms, windows, partial or absent rope: Llama's layers have none
        raise ValueError(f"a {c.architecture} draft's layers are not Llama's: transformers' Llama cannot run it")
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                         rope_parameters=rope, max_position_embeddings=c.max_position_embeddings,
                         tie_word_embeddings=False, attention_bias=c.attention_bias,
                         bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_ids or None)
    model = LlamaForCausalLM(config).to(draft.dtype)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": draft.embed_tokens.weight, "model.norm.weight": draft.norm.weight}
    for i, layer in enumerate(draft.layers):
        prefix, attn = f"model.layers.{i}.", layer.self_attn
        for name, part in zip("qkv", attn.qkv_proj.weight.split([q, kv, kv])):
            state[f"{prefix}self_attn.{name}_proj.weight"] = part
        if attn.qkv_proj.bias is not None:
            for name, part in zip("qkv", attn.qkv_proj.bias.split([q, kv, kv])):
                state[f"{prefix}self_attn.{name}_proj.bias"] = part
        state[f"{prefix}self_attn.o_proj.weight"] = attn.o_proj.weight
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        state[f"{prefix}mlp.gate_proj.weight"], state[f"{prefix}mlp.up_proj.weight"] = gate, up
        state[f"{prefix}mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        state[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight
        state[f"{prefix}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    missing, unexpected = model.load_state_dict({k: v.detach().contiguous() for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"draft weights do not map onto transformers' Llama: {missing} {unexpected}")
    if c.head_vocab_size is None:
        model.lm_head.weight = nn.Parameter(draft.lm_head.weight.detach().contiguous(), requires_grad=False)
    else:
        model.lm_head = ReducedHead(draft)
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def generate(model, prompts: list[list[int]], params: SamplingParams, pad_id: int, assistant=None,
             num_speculative_tokens: int = 5) -> list[dict]:
    """One `generate` call over a batch (left-padded); per-request figures in the shape of
    saguaro's RequestMetrics. With `ignore_eos`, EOS is forbidden until max_tokens (transformers
    has no way to sample past it), so every request decodes the same number of tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = dict(do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0) \
        if params.temperature > 0 else dict(do_sample=False)
    extra = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = num_speculative_tokens
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        extra["assistant_model"] = assistant
    if params.seed is not None:
        torch.manual_seed(params.seed)
    clock = Clock()
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=params.max_tokens,
                         min_new_tokens=params.max_tokens if params.ignore_eos else None, pad_token_id=pad_id,
                         streamer=clock, **sampling, **extra)
    steps = clock.arrivals[1:]  # after the prompt
    first, last = steps[0][0], steps[-1][0]
    rounds = [n for _, n in steps]
    eos_ids = model.generation_config.eos_token_id
    eos = set() if params.ignore_eos or eos_ids is None else set([eos_ids] if isinstance(eos_ids, int) else eos_ids)
    records = []
    for row in out[:, width:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        records.append({
            "num_prompt_tokens": int(mask[len(records)].sum()), "num_output_tokens": n,
            "ttft_s": first - started,
            "decode_tokens_per_s": (n - rounds[0]) / (last - first) if last > first else 0.0,
            "mean_acceptance_length": sum(rounds) / len(rounds) if assistant is not None else None,
            "per_position_acceptance": [sum(r - 1 > i for r in rounds) / len(rounds)
                                        for i in range(num_speculative_tokens)] if assistant is not None else None,
            "cache_hit_rate": None, "token_ids": row[:n]})
    return records


def load_llamacpp(path: Path, threads: int, context: int):
    """llama.cpp on a GGUF file, `threads` for prompt and decode alike."""
    try:
        from llama_cpp import Llama
    except ImportError as error:
        raise ImportError("the llamacpp peer needs llama-cpp-python: pip install 'saguaro[llamacpp]' "
                          "(it builds llama.cpp from source, a few minutes)") from error
    if path.suffix != ".gguf":
        raise ValueError(f"llama.cpp runs GGUF files; {path} is not one")
    return Llama(str(path), n_ctx=context, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)


def generate_llamacpp(llama, prompts: list[list[int]], params: SamplingParams, grammars: list | None = None
                      ) -> list[dict]:
    """Each prompt decoded alone from an empty cache (llama-cpp-python decodes one sequence at a
    time), sampling from the whole distribution at the temperature, as saguaro does; records in
    the shape of transformers' (see `generate`). grammars: a `llama_cpp.LlamaGrammar` (or None)
    per prompt, which llama.cpp's sampler then enforces."""
    sampling = dict(temp=params.temperature, top_k=0, top_p=1.0, min_p=0.0) if params.temperature > 0 else \
        dict(temp=0.0, top_k=1)
    eos = None if params.ignore_eos else llama.token_eos()
    records = []
    for i, prompt in enumerate(prompts):
        llama.reset()  # no prefix reuse between prompts: every method prefills each prompt
        if params.seed is not None:
            llama.set_seed(params.seed + i)
        started, times, tokens = time.perf_counter(), [], []
        for token in llama.generate(prompt, grammar=grammars[i] if grammars else None, **sampling):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == params.max_tokens or token == eos:
                break
        decode_time = times[-1] - times[0]
        records.append({"num_prompt_tokens": len(prompt), "num_output_tokens": len(tokens),
                        "ttft_s": times[0] - started,
                        "decode_tokens_per_s": (len(tokens) - 1) / decode_time if decode_time > 0 else 0.0,
                        "mean_acceptance_length": None, "per_position_acceptance": None, "cache_hit_rate": None,
                        "token_ids": tokens})
    return records
