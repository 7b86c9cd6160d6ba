"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, in the style of vLLM."""
from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence as SequenceABC
from dataclasses import replace

import torch
from tqdm import tqdm

from saguaro.config import (EngineConfig, SpeculativeConfig, add_engine_arguments, add_speculative_arguments,
                            engine_config_from_args, speculative_config_from_args, split_options)
from saguaro.engine.decoder import Decoder
from saguaro.engine.loop import AdmissionLimits, Engine
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.models import graphs, hub
from saguaro.models.loader import load_model
from saguaro.models.quantized import resolve_dtype
from saguaro.models.pairing import ResolvedModel, load_paired_draft, resolve_model
from saguaro.models.kv_cache import kv_bytes_per_token
from saguaro.models.llama import LlamaModel
from saguaro.models.tensor_parallel import tensor_parallel
from saguaro.outputs import CompletionOutput, RequestMetrics, RequestOutput
from saguaro.speculation.build import make_decoder

Prompt = str | list[dict] | list[int]


class LLM:
    """A target model and how to decode it: LLM(model, **options), each option a field of
    EngineConfig (how the model runs, how many sequences run at once) or of SpeculativeConfig;
    `model` may also be a whole EngineConfig, taken as it is.

    speculative_config: a SpeculativeConfig (or a dict of its fields) saying whether and how to
    speculate; its fields may also be given as keywords, e.g. LLM(model, method="ssd",
    num_speculative_tokens=5). method "ar" decodes autoregressively, "sd" with the draft in this
    process, "ssd" with the draft in its own worker process, which is replaced in the background
    if it dies or stops answering (decoding goes on without it meanwhile; metrics() counts
    losses and restarts), and "auto" (the default) picks AR, SD or SSD round by round where a
    draft exists (AR where none does).
    batch_invariant: each position's logits bit-identical however many tokens and requests share
    the target's pass (saguaro.models.invariant), so that greedy SD and SSD equal AR in every
    dtype and at every batch size; False trades that for the library kernels' own speed.
    quantization: how the decoder's projections are held (saguaro.models.quantized): "auto" (the
    default) runs a GGUF file's 4-bit blocks as int4 on CPU in bf16, as llama.cpp runs them,
    and everything else in `dtype`; "none" dequantizes everything to `dtype`; "int8" and "int4"
    quantize every projection (int4 keeps 4-bit GGUF blocks as they are).
    enable_prefix_caching: keep prompts' KV entries (the target's and the draft's, up to
    prefix_cache_mb MiB each, least recently used out first) so that a prompt starting like an
    earlier one, or the n samples of one prompt, run only what is new
    (saguaro.models.prefix_cache). Batch-invariant decoding gives the same tokens either way.
    tensor_parallel_size: the target's layers split over this many processes on this machine's
    CPU cores (saguaro.models.tensor_parallel), or over the ranks of a `torchrun` launch, where
    `LLM(...)` serves rank 0 on the other ranks and exits them when it closes. It runs full
    precision (quantization "auto" means "none" there) without prefix caching.
    max_num_seqs, kv_cache_mb: the engine runs at most max_num_seqs sequences at once, whose
    rows of the target's KV cache (each as long as the longest sequence needs) take at most
    kv_cache_mb MiB; the others wait and are admitted in arrival order as running ones finish.
    The cache is reserved for what runs at once, not for every request. A request that alone
    exceeds the budget is refused (ValueError).
    target: a model already loaded to decode instead of loading `model`'s (which still gives the
    tokenizer and the draft), e.g. a twin (saguaro.models.twin) that several engines share.
    """

    def __init__(self, model: str | EngineConfig = hub.DEFAULT_MODEL,
                 speculative_config: SpeculativeConfig | dict | None = None, target: LlamaModel | None = None,
                 **options):
        engine_options, speculative_options = split_options(options)
        if isinstance(model, EngineConfig):
            self.engine_config = config = replace(model, **engine_options) if engine_options else model
        else:
            self.engine_config = config = EngineConfig(model, **engine_options)
        self.speculative_config = spec = SpeculativeConfig.of(speculative_config, **speculative_options)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype)
        self.model: ResolvedModel = resolve_model(config.model, spec.draft, spec.ssd_draft, spec.method != "ar")
        self.tokenizer = self.model.tokenizer
        if target is not None:  # already loaded (e.g. a twin of `model`: saguaro.models.twin), shared by engines
            self.target = target
        elif config.tensor_parallel_size == 1:
            self.target = load_model(self.model.path, self.dtype, config.device, config.quantization)
        else:
            self.target = tensor_parallel(self.model.path, self.dtype, config.tensor_parallel_size, config.device,
                                          config.batch_invariant)
        self.target.set_batch_invariant(config.batch_invariant)
        graphs.attach(self.target, config.cuda_graphs)
        self.eos_token_ids = self.target.config.eos_token_ids or [self.tokenizer.eos_token_id]
        self._ids = itertools.count()
        draft = load_paired_draft(self.model, self.target) if spec.drafts_in_process else None
        decoder = make_decoder(self.target, spec, self.model, draft, config.prefix_cache_budget_mb)
        self.engine = Engine(decoder, AdmissionLimits.of_budget(config.max_num_seqs, config.kv_cache_mb,
                                                                kv_bytes_per_token(self.target.config, self.target.dtype)))

    @property
    def method(self) -> str:
        return self.speculative_config.method

    @property
    def decoder(self) -> Decoder:
        return self.engine.decoder

    def wait_for_ssd(self, start: bool = False) -> None:
        """Blocks until method="auto"'s SSD worker is up (or failed to start), so that SSD is
        among its choices from the next round; start: start it now rather than when auto first
        judges it worth a core. Returns at once for other methods."""
        self.decoder.wait_for_ssd(start)

    @contextlib.contextmanager
    def decoding_with(self, engine: Engine) -> Iterator[None]:
        """generate decodes with `engine` (another decoder over this target: the benchmark runs
        its methods side by side on one loaded model) until the block ends."""
        own, self.engine = self.engine, engine
        try:
            yield
        finally:
            self.engine = own

    def close(self) -> None:
        """Stops the draft worker, if any, and a tensor-parallel target's other ranks (also done
        at exit), and gives back the core the worker had."""
        self.decoder.close()
        if self.target.tensor_parallel is not None:
            self.target.tensor_parallel.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict:
        """Engine-wide SSD figures: cache hit rate, acceptance on hit / miss, T_p, wait time,
        draft workers lost and restarted (empty for AR and SD)."""
        return self.decoder.metrics()

    def encode(self, prompt: Prompt, tools: list[dict] | None = None, template_variables: dict | None = None) -> list[int]:
        """Token ids of a text prompt, a chat (list of messages; the chat template is applied,
        given the tools, in OpenAI's form, and any other variables it reads) or already
        tokenized ids."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     **(template_variables or {}))
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise TypeError("a prompt is a string, a list of chat messages or a list of token ids")

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, on_token: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        """Decodes the prompts together, as many at once as the engine admits (the others join
        as running ones finish); returns one RequestOutput per prompt, in order, with
        SamplingParams.n samples each (the prompt runs once, the others reuse it through the
        prefix cache). Raises ValueError for a prompt + max_tokens beyond the model's context
        or the KV cache budget.

        on_token(index, new_text) is called as text becomes final (for streaming, n = 1): the
        pieces of a prompt add up to its output's text."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (dict, int))):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, SequenceABC) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if on_token is not None and any(p.n > 1 for p in params):
            raise ValueError("on_token streams one sample per prompt: use n = 1")
        samples = [[self.new_sequence(ids, sample) for sample in sp.samples()]
                   for ids, sp in zip(map(self.encode, prompts), params)]
        seqs = [seq for group in samples for seq in group]
        longest = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs) + self.decoder.lookahead
        limit = self.target.config.max_position_embeddings
        if longest > limit:
            raise ValueError(f"prompt + max_tokens ({longest} tokens) exceeds the model's context of {limit}")
        index = {s.seq_id: i for i, group in enumerate(samples) for s in group}
        self.engine.add(seqs)
        total = sum(s.params.max_tokens for s in seqs)
        try:
            with tqdm(total=total, desc="generating", unit="tok", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished:
                    for update in self.engine.step().updates:
                        if on_token is not None and update.new_text:
                            on_token(index[update.seq.seq_id], update.new_text)
                    bar.update(sum(s.params.max_tokens if s.finished else len(s.output_ids) for s in seqs) - bar.n)
        except BaseException:  # interrupted or failed: free what the batch held for the next call
            self.engine.abort(seqs)
            raise
        return [self._output(group, prompt) for group, prompt in zip(samples, prompts)]

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, arrival: float | None = None) -> Sequence:
        """A request for this engine's decoder, with an id unique in this LLM (generate and the
        server's scheduler both make them); arrival: when it came (perf_counter; now if None)."""
        return Sequence(next(self._ids), prompt_ids, params, self.eos_token_ids, self.tokenizer, arrival)

    def _output(self, samples: list[Sequence], prompt: Prompt) -> RequestOutput:
        k = self.decoder.num_speculative_tokens
        outputs = [CompletionOutput(j, s.text, s.output_ids, s.finish_reason,
                                    RequestMetrics.of(s.stats, len(s.output_ids), k),
                                    s.logprobs if s.params.logprobs is not None else None)
                   for j, s in enumerate(samples)]
        first = outputs[0]
        return RequestOutput(request_id=samples[0].seq_id, prompt=prompt, prompt_token_ids=samples[0].prompt_ids,
                             text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
                             metrics=first.metrics, outputs=outputs, prompt_logprobs=samples[0].prompt_logprobs)


def add_llm_arguments(parser: argparse.ArgumentParser, defaults: dict[str, tuple[object, str]] | None = None) -> None:
    """LLM's options on a command line: EngineConfig's, then SpeculativeConfig's. defaults:
    EngineConfig field -> (another default, how the help should describe it)."""
    add_engine_arguments(parser, defaults=defaults)
    add_speculative_arguments(parser)


def llm_from_args(args: argparse.Namespace) -> LLM:
    """The LLM the options of add_llm_arguments describe."""
    return LLM(engine_config_from_args(args), speculative_config_from_args(args))
