"""Distillation on a tiny random-weight target: the teacher cache, training and the evaluation
loop, in seconds on a CPU."""
import itertools

import pytest
import torch

from saguaro.distill import evaluate
from saguaro.distill.draft import DraftSpec, init_draft, select_vocab, target_layers
from saguaro.distill.teacher import TeacherConfig, length_batches, target_features, teach_batch
from saguaro.distill.train import TrainConfig, split_heldout, train
from saguaro.models.config import ModelConfig
from saguaro.models.llama import LlamaModel

VOCAB = 64


def tiny_target(**features) -> LlamaModel:
    """features: ModelConfig's fields of another architecture (TINY_ARCHITECTURES)."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8, eos_token_ids=[], **features)
    model = LlamaModel(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # peaked, context-dependent distributions worth imitating
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def sequences(target):
    return teacher_sequences(target)


def teacher_sequences(target: LlamaModel) -> list:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 12, (96,), generator=gen)]
    config = TeacherConfig(top_k=16, new_tokens=12, batch_size=32)
    return [s for batch in length_batches(prompts, config.batch_size)
            for s in teach_batch(target, batch, config, eos_ids=set())]


def test_teacher_records_greedy_continuations(target, sequences):
    s = sequences[0]
    assert len(s.tokens) == s.num_prompt + 12 and s.topk_ids.shape == (len(s.tokens) - 1, 16)
    # the generated tokens are the teacher's own first choices
    assert torch.equal(s.topk_ids[s.num_prompt - 1:, 0], s.tokens[s.num_prompt:])
    with torch.no_grad():
        from saguaro.distill.train import PassCache
        n = len(s.tokens)
        logits = target.logits(target(s.tokens[None].long(), torch.arange(n)[None], PassCache(n)))[0, :-1]
    assert torch.equal(logits.topk(16).indices.int()[:, 0], s.topk_ids[:, 0])


SPECS = {"standalone": DraftSpec(layers=(0, 3), head_vocab=48), "eagle": DraftSpec(layers=(3,), head_vocab=48, eagle=True)}


def distill(target, sequences, lr: float, kind: str) -> list[dict]:
    if SPECS[kind].eagle:
        for s, f in zip(sequences, target_features(target, sequences)):
            s.features = f
    train_seqs, heldout = split_heldout(sequences, every=4)
    vocab = select_vocab(train_seqs, 48, VOCAB)
    draft = init_draft(target, SPECS[kind], vocab)
    config = TrainConfig(steps=40, rows=4, row_len=64, lr=lr, warmup=5, eval_every=40, seed=0)
    return train(draft, train_seqs, heldout, config, log=lambda _: None)


@pytest.mark.parametrize("kind", list(SPECS))
def test_training_lowers_heldout_kl(target, sequences, kind):
    history = distill(target, sequences, lr=3e-3, kind=kind)
    assert history[-1]["kl"] < 0.6 * history[0]["kl"]
    assert history[-1]["top1"] > history[0]["top1"]


@pytest.mark.parametrize("kind", list(SPECS))
def test_heldout_kl_moves_only_through_training(target, sequences, kind):
    history = distill(target, sequences, lr=0.0, kind=kind)
    assert history[-1]["kl"] == pytest.approx(history[0]["kl"], rel=1e-6)


def test_resume_continues_the_same_run(target, sequences, tmp_path):
    train_seqs, heldout = split_heldout(sequences, every=4)
    vocab = select_vocab(train_seqs, 48, VOCAB)
    config = TrainConfig(steps=6, rows=4, row_len=64, lr=3e-3, warmup=2, eval_every=3, checkpoint_every=3)
    straight = init_draft(target, DraftSpec(layers=(0, 3), head_vocab=48), vocab)
    train(straight, train_seqs, heldout, config, log=lambda _: None)
    resumed = init_draft(target, DraftSpec(layers=(0, 3), head_vocab=48), vocab)
    train(resumed, train_seqs, heldout, TrainConfig(**{**vars(config), "steps": 3}), tmp_path, log=lambda _: None)
    resumed = init_draft(target, DraftSpec(layers=(0, 3), head_vocab=48), vocab)
    train(resumed, train_seqs, heldout, config, tmp_path, log=lambda _: None)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_draft_equal_to_target_is_always_accepted(target, temperature):
    result = evaluate.acceptance(target, target, [[1, 2, 3], [5, 6, 7, 8]], k=4, temperature=temperature,
                                 new_tokens=20)
    assert result.lengths and all(n == 5 for n in result.lengths)
    assert result.per_token() == pytest.approx(1.0, abs=1e-6)


def test_batch_schedule_walks_epochs_of_different_sizes():
    """Each epoch packs its own shuffle: a later epoch may hold fewer batches than the first
    (a 1,200-step run once ran out of rows in its second epoch)."""
    from saguaro.distill.teacher import Sequence
    from saguaro.distill.train import batch_schedule, epoch_rows

    lengths = torch.randint(5, 60, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    seqs = [Sequence(torch.zeros(n, dtype=torch.int32), 1, torch.zeros(n - 1, 2, dtype=torch.int32),
                     torch.zeros(n - 1, 2, dtype=torch.float16)) for n in lengths]
    config = TrainConfig(rows=2, row_len=64)
    sizes = [len(epoch_rows(seqs, config, epoch)) // config.rows for epoch in range(4)]
    assert len(set(sizes)) > 1  # the case under test
    steps = list(itertools.islice(batch_schedule(seqs, config), sum(sizes)))
    assert [epoch for epoch, _ in steps] == [e for e, n in enumerate(sizes) for _ in range(n)]
    for epoch, rows in steps:
        assert len(rows) == config.rows and all(rows)


# Each architecture's features on the tiny target: Gemma's norms, GeGLU, scaled embeddings, soft
# caps, query scale, windows and local rope; Phi-3's partial rope and windows; SmolLM3's layer
# without rope.
TINY_ARCHITECTURES = {
    "gemma": dict(mlp_activation="gelu_tanh", norm_offset=1.0, embed_scale=32 ** 0.5, post_norms=True, qk_norm=True,
                  attn_scale=0.25, attn_softcap=20.0, logit_softcap=30.0, sliding_window=4, sliding_layers=[0, 1, 2],
                  rope_local_theta=1000.0),
    "phi3": dict(partial_rotary_factor=0.5, sliding_window=6, sliding_layers=[0, 1, 2, 3]),
    "smollm3": dict(no_rope_layers=[3]),
}


@pytest.mark.parametrize("architecture", list(TINY_ARCHITECTURES))
def test_distill_makes_a_draft_for_any_architecture(architecture):
    """The default layers (the first and the last) fit any target; the draft keeps what its
    layers had (a window, no rope), learns, and drafts for SD with greedy output equal to AR."""
    from drafts import sd_decoder
    from saguaro.engine.sampler import SamplingParams
    from saguaro.speculation.build import ar_decoder
    from test_exactness import NEW, tiny_outputs

    target = tiny_target(**TINY_ARCHITECTURES[architecture])
    sequences = teacher_sequences(target)
    layers = target_layers("0,-1", target.config.num_layers)
    assert layers == (0, 3)
    train_seqs, heldout = split_heldout(sequences, every=4)
    draft = init_draft(target, DraftSpec(layers=layers, head_vocab=48), select_vocab(train_seqs, 48, VOCAB))
    assert draft.config.sliding_layers == [i for i, j in enumerate(layers) if j in target.config.sliding_layers]
    assert draft.config.no_rope_layers == [i for i, j in enumerate(layers) if j in target.config.no_rope_layers]
    config = TrainConfig(steps=40, rows=4, row_len=64, lr=3e-3, warmup=5, eval_every=40, seed=0)
    history = train(draft, train_seqs, heldout, config, log=lambda _: None)
    assert history[-1]["kl"] < 0.6 * history[0]["kl"]
    draft = draft.eval().requires_grad_(False)
    greedy = [SamplingParams(temperature=0, max_tokens=NEW) for _ in range(8)]
    assert tiny_outputs(sd_decoder(target, draft, 3), greedy) == tiny_outputs(ar_decoder(target), greedy)


def test_layers_are_checked_before_any_teacher_text():
    assert target_layers("0,-1", 30) == (0, 29) and target_layers("2,-3", 26) == (2, 23)
    with pytest.raises(ValueError, match="the target has 26 layers .* names 29"):
        target_layers("0,29", 26)
