"""`saguaro distill`: teacher data -> draft initialization -> training -> export -> evaluation.

Every stage resumes: teacher shards already on disk are kept, training continues from
OUT/train_state.pt, so rerunning the same command after an interruption finishes the job.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from saguaro.distill import draft as draft_lib
from saguaro.distill import evaluate, teacher
from saguaro.distill.train import TrainConfig, split_heldout, train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: a known name or a checkpoint path")
    parser.add_argument("--out", required=True, type=Path, help="working folder; the draft lands in OUT/draft")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    data = parser.add_argument_group("teacher data")
    data.add_argument("--chat-prompts", type=int, default=4500, help="ShareGPT train-split first turns")
    data.add_argument("--code-prompts", type=int, default=None,
                      help="Python standard-library functions, each used as a raw and a chat prompt (default: all)")
    data.add_argument("--teacher-batches", type=int, default=None, help="stop generating after this many batches")
    data.add_argument("--top-k", type=int, default=32, help="teacher logits kept per position")
    data.add_argument("--new-tokens", type=int, default=128, help="greedy tokens the target generates per prompt")
    model = parser.add_argument_group("draft")
    model.add_argument("--eagle", action="store_true",
                       help="an EAGLE-style draft: one layer (--layers names it) reading the target's hidden states")
    model.add_argument("--init-from", type=Path, default=None,
                       help="with --eagle: a trained standalone draft to start from (its layers, head and vocabulary)")
    model.add_argument("--layers", default="0,-1", help="target layers the draft's layers are copied from, negative "
                                                       "ones from the end (default: the first and the last)")
    model.add_argument("--head-vocab", type=int, default=8192, help="tokens the draft's head predicts")
    opt = parser.add_argument_group("training")
    opt.add_argument("--steps", type=int, default=TrainConfig.steps)
    opt.add_argument("--rows", type=int, default=TrainConfig.rows)
    opt.add_argument("--row-len", type=int, default=TrainConfig.row_len)
    opt.add_argument("--lr", type=float, default=TrainConfig.lr)
    opt.add_argument("--warmup", type=int, default=TrainConfig.warmup, help="steps of linear learning-rate warmup")
    opt.add_argument("--prompt-weight", type=float, default=TrainConfig.prompt_weight)
    opt.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    opt.add_argument("--unroll", type=int, default=TrainConfig.unroll,
                     help="EAGLE: training passes, each reading the previous pass's own guesses")
    opt.add_argument("--feature-weight", type=float, default=TrainConfig.feature_weight,
                     help="EAGLE: weight of the hidden-state regression loss")
    ev = parser.add_argument_group("evaluation (held-out prompts, after training)")
    ev.add_argument("--eval-prompts", type=int, default=20, help="HumanEval and held-out ShareGPT prompts each; 0 skips")
    ev.add_argument("--eval-k", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    from saguaro.datasets import sharegpt_first_turns
    from saguaro.models import checkpoint, hub, loader, pairing, tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = hub.resolve(args.target)
    target = loader.load_model(path, torch.bfloat16)
    try:  # before hours of teacher text
        layers = draft_lib.target_layers(args.layers, target.config.num_layers)
    except ValueError as e:
        raise SystemExit(f"saguaro distill: {e}") from None
    tokenizer = tokenizer.load_tokenizer(path)
    eos_ids = set(target.config.eos_token_ids) | {tokenizer.eos_token_id}

    tconfig = teacher.TeacherConfig(top_k=args.top_k, new_tokens=args.new_tokens, seed=args.seed)
    prompts = teacher.training_prompts(tokenizer, sharegpt_first_turns("train", limit=args.chat_prompts, seed=args.seed),
                                       teacher.stdlib_functions(args.code_prompts), tconfig)
    batches = teacher.length_batches(prompts, tconfig.batch_size)[:args.teacher_batches]
    started = time.time()
    with tqdm(total=len(batches), desc="teacher", unit="batch") as bar:
        shards = list(teacher.generate_shards(target, batches, out / "teacher", tconfig, eos_ids, bar))
    if args.eagle:
        with tqdm(total=len(shards), desc="target features", unit="shard") as bar:
            sequences = teacher.with_features(target, shards, bar)
    else:
        sequences = [s for file in shards for s in teacher.load_shard(file)]
    train_seqs, heldout_seqs = split_heldout(sequences)

    spec = draft_lib.DraftSpec(layers=layers, head_vocab=args.head_vocab, eagle=args.eagle)
    if args.init_from:
        if not args.eagle:
            raise SystemExit("--init-from starts an EAGLE draft from a standalone one: add --eagle")
        draft = draft_lib.eagle_from(pairing.load_draft(args.init_from, target, torch.float32))
        spec = draft_lib.DraftSpec(layers=tuple(range(draft.config.num_layers)), head_vocab=draft.config.head_vocab_size,
                                   eagle=True)
    else:
        vocab = draft_lib.select_vocab(train_seqs, spec.head_vocab, target.config.vocab_size, sorted(eos_ids))
        draft = draft_lib.init_draft(target, spec, vocab)
    config = TrainConfig(steps=args.steps, rows=args.rows, row_len=args.row_len, lr=args.lr, warmup=args.warmup,
                         prompt_weight=args.prompt_weight, eval_every=args.eval_every, seed=args.seed,
                         unroll=args.unroll, feature_weight=args.feature_weight)
    history = train(draft, train_seqs, heldout_seqs, config, out, log=tqdm.write)
    checkpoint.save_checkpoint(draft, out / "draft")

    report = {"teacher": asdict(tconfig),
              "draft": {**asdict(spec), "init_from": str(args.init_from) if args.init_from else None}, "train": asdict(config), "minutes": (time.time() - started) / 60,
              "sequences": {"train": len(train_seqs), "heldout": len(heldout_seqs)},
              "tokens": {"train_generated": sum(len(s.tokens) - s.num_prompt for s in train_seqs),
                         "train_prompt": sum(s.num_prompt for s in train_seqs)},
              "heldout": history[-1]}
    if args.eval_prompts:
        shipped = pairing.load_draft(out / "draft", target, torch.bfloat16)
        report["speculative"] = evaluate_draft(target, shipped, tokenizer, args.eval_prompts, args.eval_k, eos_ids, args.seed)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    tqdm.write(json.dumps(report, indent=2))
    return report


def evaluate_draft(target, draft, tokenizer, n: int, k: int, eos_ids: set[int], seed: int) -> dict:
    """Acceptance at temperatures 0 and 0.7 on HumanEval and held-out ShareGPT prompts (chat
    template applied), and the draft's step time against one verification."""
    from saguaro.datasets import humaneval_prompts, sharegpt_first_turns

    sets = {"humaneval": humaneval_prompts()[:n], "sharegpt_heldout": sharegpt_first_turns("heldout", limit=n, seed=seed)}
    results = {}
    for name, texts in sets.items():
        prompts = [teacher.chat_ids(tokenizer, t) for t in texts]
        for temperature in (0.0, 0.7):
            with tqdm(total=len(prompts), desc=f"{name} T={temperature}", unit="prompt") as bar:
                acc = evaluate.acceptance(target, draft, prompts, k, temperature, eos_ids=eos_ids, seed=seed, progress=bar)
            results[f"{name} T={temperature}"] = {
                "mean_acceptance_length": round(acc.mean, 3), "per_token_acceptance": round(acc.per_token(), 3),
                "per_position": [round(x, 3) for x in acc.per_position()], "rounds": len(acc.lengths)}
    # 16 branches as 16 rows, and as SSD's tree decode lays them out: one row of 16 tokens.
    rows_ms = evaluate.step_ms(draft, rows=16, tokens=1)
    tree_ms = evaluate.step_ms(draft, rows=1, tokens=16)
    verify_ms = evaluate.step_ms(target, rows=1, tokens=k + 1)
    results["timing"] = {"threads": torch.get_num_threads(),
                         "draft_step_16_rows_ms": round(rows_ms, 2), "draft_step_16_branch_tree_ms": round(tree_ms, 2),
                         f"verify_{k + 1}_tokens_ms": round(verify_ms, 2),
                         "ratio_16_rows": round(rows_ms / verify_ms, 3), "ratio_tree": round(tree_ms / verify_ms, 3)}
    return results


def cli_main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="saguaro distill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    cli_main()
