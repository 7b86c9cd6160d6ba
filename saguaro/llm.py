"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, in the style of vLLM."""
from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence as SequenceABC

import torch
from tqdm import tqdm

from saguaro.draft.client import DraftClient, WorkerConfig, use_cores
from saguaro.draft.fanout import geometric_fan_out, uniform_fan_out
from saguaro.engine.decoders import ARDecoder, SDDecoder
from saguaro.engine.ssd import GeometricPlan, SSDDecoder
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.models import hub
from saguaro.models.loader import IncompatibleDraftError, load_draft, load_model, load_tokenizer, resolve_dtype
from saguaro.outputs import RequestMetrics, RequestOutput

METHODS = ("ar", "sd", "ssd")
Prompt = str | list[dict] | list[int]


def usable_cores() -> set[int]:
    """The cores this process may run on: its affinity where the OS keeps one (Linux), else all."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def split_cores(draft_device: str) -> str | None:
    """On CPU, the draft worker gets the last core and this process keeps the others, so
    drafting and verifying really run in parallel."""
    cores = sorted(usable_cores())
    if draft_device != "cpu" or len(cores) < 2:
        return None
    use_cores(set(cores[:-1]), len(cores) - 1)
    return str(cores[-1])


class LLM:
    """A target model and a decoding method.

    method: "ar" (autoregressive), "sd" (speculative decoding with the draft in this process)
    or "ssd" (speculative speculative decoding, the draft in its own worker process).
    draft: a checkpoint; for a known target, its shipped distilled draft by default.
    SSD options: fan_out ("geometric", "uniform" or K+1 integers), fan_out_budget (branches
    per request), saguaro_c (Saguaro sampling constant, 1 = off), backup ("auto", "neural",
    "fast"), draft_device, draft_address ("HOST:PORT" to await a worker started elsewhere),
    acceptance_rate and power_law_r (the geometric fan-out's a and r; a is then re-fitted to the
    measured acceptance every 16 rounds). A worker that dies or stops answering (for a few
    typical rounds, at least a second) is replaced in the background, or awaited again at
    draft_address, while decoding goes on without it; metrics() counts losses and restarts.
    prompt_lookup (SD and SSD): N to speculate, wherever the last N tokens occurred earlier in
    the text, the tokens that followed them instead of the draft's (saguaro.engine.lookup);
    None or 0 turns it off.
    batch_invariant: each position's logits bit-identical however many tokens and requests share
    the target's pass (saguaro.models.invariant), so that greedy SD and SSD equal AR in every
    dtype and at every batch size; False trades that for the library kernels' own speed.
    """

    def __init__(self, model: str = hub.DEFAULT_MODEL, draft: str | None = None, method: str = "ar",
                 num_speculative_tokens: int = 5, device: str = "cpu", dtype: str | torch.dtype = "auto",
                 num_threads: int | None = None, fan_out: str | list[int] = "geometric",
                 fan_out_budget: int = 16, saguaro_c: float = 1.0, backup: str = "auto",
                 draft_device: str = "cpu", draft_address: str | None = None,
                 acceptance_rate: float = 0.75, power_law_r: float = 0.6, prompt_lookup: int | None = 2,
                 batch_invariant: bool = True):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.method = method
        self.dtype = resolve_dtype(dtype)
        path = hub.resolve(model)
        self.tokenizer = load_tokenizer(path)
        self.target = load_model(path, self.dtype, device)
        self.target.set_batch_invariant(batch_invariant)
        self.eos_token_ids = self.target.config.eos_token_ids or [self.tokenizer.eos_token_id]
        self._ids = itertools.count()
        self._cores_before: tuple[set[int], int] | None = None  # restored by close()
        if method == "ar":
            self.decoder = ARDecoder(self.target)
            return
        draft_path = hub.resolve(draft) if draft else hub.default_draft(str(model))
        if draft_path is None:
            raise ValueError(f"method {method!r} needs a draft model (no shipped draft for {model!r})")
        if method == "sd":
            self.draft = load_draft(draft_path, self.target)
            self.decoder = SDDecoder(self.target, self.draft, num_speculative_tokens, prompt_lookup)
            return
        k = num_speculative_tokens
        plan = None
        if fan_out == "geometric":
            fan_out = geometric_fan_out(fan_out_budget, k, acceptance_rate, power_law_r)
            plan = GeometricPlan(fan_out_budget, power_law_r)
        elif fan_out == "uniform":
            fan_out = uniform_fan_out(fan_out_budget, k)
        self._cores_before = usable_cores(), torch.get_num_threads()
        config = WorkerConfig(str(draft_path), str(self.dtype).removeprefix("torch."), k, list(fan_out),
                              saguaro_c, draft_device, None if draft_address else split_cores(draft_device),
                              draft_address, prompt_lookup=prompt_lookup)
        client = DraftClient(config, self.target.embed_tokens.weight.detach().cpu(), device)
        if client.ready.vocab_size != self.target.config.vocab_size:
            client.close()
            raise IncompatibleDraftError(f"the draft's vocabulary ({client.ready.vocab_size} tokens) does not "
                                         f"match the target's ({self.target.config.vocab_size})")
        self.decoder = SSDDecoder(self.target, client, backup, plan)

    def close(self) -> None:
        """Stops the draft worker, if any (also done at exit), and gives back the core it had."""
        if isinstance(self.decoder, SSDDecoder):
            self.decoder.close()
        if self._cores_before is not None:
            use_cores(*self._cores_before)
            self._cores_before = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict:
        """Engine-wide SSD figures: cache hit rate, acceptance on hit / miss, T_p, wait time,
        draft workers lost and restarted."""
        return self.decoder.stats.summary() if isinstance(self.decoder, SSDDecoder) else {}

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, a chat (list of messages; the chat template is applied)
        or already tokenized ids."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise TypeError("a prompt is a string, a list of chat messages or a list of token ids")

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, on_token: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        """Decodes every prompt as one batch; returns one RequestOutput per prompt, in order.

        on_token(index, new_text) is called as text becomes final (for streaming): the pieces
        of a prompt add up to its output's text."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (dict, int))):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, SequenceABC) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        seqs = [self.new_sequence(self.encode(p), sp) for p, sp in zip(prompts, params)]
        longest = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs) + self.decoder.lookahead
        limit = self.target.config.max_position_embeddings
        if longest > limit:
            raise ValueError(f"prompt + max_tokens ({longest} tokens) exceeds the model's context of {limit}")
        self.decoder.reserve(len(seqs), longest)
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        total = sum(s.params.max_tokens for s in seqs)
        with tqdm(total=total, desc="generating", unit="tok", disable=not use_tqdm) as bar:
            def after_round(active: list[Sequence]) -> None:
                if on_token is not None:
                    for seq in active:
                        if new := seq.detokenizer.take_stream():
                            on_token(index[seq.seq_id], new)
                self.decoder.release([s for s in active if s.finished])
                bar.n = sum(s.params.max_tokens if s.finished else len(s.output_ids) for s in seqs)
                bar.refresh()

            self.decoder.prefill(seqs)
            after_round(seqs)
            while active := [s for s in seqs if not s.finished]:
                self.decoder.step(active)
                after_round(active)
        return [self._output(seq, prompt) for seq, prompt in zip(seqs, prompts)]

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """A request for this engine's decoder, with an id unique in this LLM (generate and the
        server's scheduler both make them)."""
        return Sequence(next(self._ids), prompt_ids, params, self.eos_token_ids, self.tokenizer)

    def _output(self, seq: Sequence, prompt: Prompt) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id, prompt=prompt, prompt_token_ids=seq.prompt_ids, text=seq.text,
            token_ids=seq.output_ids, finish_reason=seq.finish_reason,
            metrics=RequestMetrics.of(seq.stats, len(seq.output_ids), getattr(self.decoder, "k", None)))
