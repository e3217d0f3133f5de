"""
Named sizes of everything `make train` builds: the corpus budget, the tokenizer's vocabulary, the target and
draft shapes, and each stage's TrainConfig. `python train_tiny.py --preset NAME` picks one; the benchmark reads
them to name the preset a checkpoint came from.
"""
from nanospec.model.gpt import GPTConfig
from nanospec.training.trainer import TrainConfig

# Named sizes. `tiny` is the default: all of `make train` within 9.5 minutes on a 2-core CPU in fp32.
# `gpu` is for one H100-class GPU (about 5 minutes), `small` an older GPU shape. `toy` is for tests and smoke
# runs (seconds, useless output). Optional keys: corpus_tests (walk the corpus's test folders too),
# corpus_packages (site-packages too, validation held out by package: nanospec/training/corpus.py), tokenizer_chars
# (train the tokenizer on a sample of this many characters of train.txt), parallelspec (ParallelSpecConfig fields).
# A TrainConfig's expected_steps is what the stage reaches on the preset's reference machine, quiet: the end of
# `make train` says when a stage got less than half (nanospec/training/pipeline.py, starved_report).
PRESETS = {
    "toy": dict(corpus_bytes=300_000, vocab_size=320, head_weight=0.3, head_fraction=0.25,
                target=GPTConfig(vocab_size=0, block_size=64, n_layer=2, n_head=2, n_embd=32, n_future=2),
                draft=GPTConfig(vocab_size=0, block_size=64, n_layer=1, n_head=2, n_embd=16, n_future=0),
                target_train=TrainConfig(max_iters=30, batch_size=8, eval_interval=15, warmup_iters=5),
                heads_train=TrainConfig(max_iters=10, batch_size=8, eval_interval=5, warmup_iters=2),
                draft_train=TrainConfig(max_iters=20, batch_size=8, eval_interval=10, warmup_iters=5),
                eagle_train=TrainConfig(max_iters=20, batch_size=8, eval_interval=10, warmup_iters=5),
                parallelspec_train=TrainConfig(max_iters=20, batch_size=8, eval_interval=10, warmup_iters=5),
                early_exit_train=TrainConfig(max_iters=20, batch_size=8, eval_interval=10, warmup_iters=5)),
    # tiny: deep and thin, so that a one-layer drafter costs about a tenth of a target forward; Muon, width 64
    # and MTP heads on 1/16 of the positions bought the most learning per CPU-second in fp32 (docs/training.md, "Choosing the tiny target")
    "tiny": dict(corpus_bytes=4_000_000, vocab_size=2048, head_weight=0.3, head_fraction=1 / 16,
                 target=GPTConfig(vocab_size=0, block_size=256, n_layer=8, n_head=4, n_embd=64, n_future=3),
                 draft=GPTConfig(vocab_size=0, block_size=256, n_layer=1, n_head=2, n_embd=96, n_future=0),
                 # expected_steps: the quiet 2-core Intel Xeon VM of docs/training.md's log (2026-11-24, fp32).
                 # lr (AdamW's: the tied embedding, norms, MTP heads) 2e-2, ten times the default: at equal steps (and
                 # a step costs the same) it took 567 steps from 2.2 to 1.9 bits per byte (docs/training.md, issue 35)
                 target_train=TrainConfig(max_iters=1500, max_seconds=315, optimizer="muon", lr=2e-2, min_lr=2e-3,
                                          expected_steps=1089),
                 # heads-only phase (nanospec/training/heads.py): a fine-tune, so a large rate and no decay
                 heads_train=TrainConfig(max_iters=200, max_seconds=45, lr=3e-3, min_lr=3e-4, warmup_iters=10,
                                         weight_decay=0.0, eval_interval=50, expected_steps=113),
                 # draft: distilled from the target (drafter_losses.draft_losses), each step pays a target forward too;
                 # sum(min(p, q)) at t=1 0.52 (corpus cross-entropy, 40 s) -> 0.62 at the rates before (3e-3, Muon
                 # 0.02) -> 0.68 at twice them; four times: 0.67 (docs/training-notes.md)
                 draft_train=TrainConfig(max_iters=450, max_seconds=90, lr=6e-3, muon_lr=0.04, optimizer="muon",
                                         expected_steps=384),
                 # eagle: twice the rate and 1.5x the steps of before (lr 6e-3, 300) in the same 60 s: t=1 chain
                 # tokens per forward 2.51 -> 2.67, like 1200 steps at the old rate (docs/training-notes.md)
                 eagle_train=TrainConfig(max_iters=450, max_seconds=60, lr=1.2e-2, warmup_iters=20, expected_steps=450),
                 parallelspec_train=TrainConfig(max_iters=600, max_seconds=50, batch_size=8, lr=3e-3, warmup_iters=20,
                                                expected_steps=600),
                 early_exit_train=TrainConfig(max_iters=150, max_seconds=25, lr=3e-3, warmup_iters=20,
                                              expected_steps=150)),
    "small": dict(corpus_bytes=20_000_000, vocab_size=4096, head_weight=0.3, head_fraction=0.25,
                  target=GPTConfig(vocab_size=0, block_size=512, n_layer=8, n_head=8, n_embd=512, n_future=4),
                  draft=GPTConfig(vocab_size=0, block_size=512, n_layer=2, n_head=4, n_embd=192, n_future=0),
                  target_train=TrainConfig(max_iters=5000, batch_size=32, lr=1e-3, min_lr=1e-4, warmup_iters=200),
                  heads_train=TrainConfig(max_iters=1000, batch_size=32, lr=1e-3, warmup_iters=50, weight_decay=0.0),
                  draft_train=TrainConfig(max_iters=3000, batch_size=32, lr=2e-3, warmup_iters=100),
                  eagle_train=TrainConfig(max_iters=3000, batch_size=32, lr=2e-3, warmup_iters=100),
                  parallelspec_train=TrainConfig(max_iters=3000, batch_size=32, lr=2e-3, warmup_iters=100),
                  early_exit_train=TrainConfig(max_iters=1000, batch_size=32, lr=2e-3, warmup_iters=50)),
    # gpu: deep and thin like tiny, so that one drafter layer is 1/16 of the target: 16 x 384 reached 1.271 bits
    # per byte in 60 s on an H100 where 8 x 512 reached 1.315 and then overfit its 7 MB (issue 19). On the 7.6 MB
    # stdlib with its tests an H200 ran 5100 target steps of 32 x 512 tokens in 140 s: 83M tokens, ~40 passes,
    # and validation rose after step 2000 (issue 35). So the corpus is the stdlib, its tests AND every installed
    # package (site-packages), up to 400 MB: 83M tokens are ~290 MB of text at ~3.5 bytes per token, so a machine
    # with 150-300 MB of Python source (this 2-core VM: 154 MB of training text; a GPU machine's torch, sympy,
    # scipy, pandas...: ~300 MB) trains 1-2 passes, within the ~4 that cost almost nothing (Muennighoff et al.
    # 2023). Stage budgets (seconds) sum to 260 s plus corpus (~15 s), tokenizer and tokens (~30 s on 16 cores) and
    # loading: about 5 minutes on one H100 in bf16, chosen from those figures, not measured (no GPU was at hand);
    # max_iters are out of the way, time binds.
    "gpu": dict(corpus_bytes=400_000_000, corpus_tests=True, corpus_packages=True, tokenizer_chars=8_000_000,
                vocab_size=4096,
                head_weight=0.3, head_fraction=1 / 8,
                target=GPTConfig(vocab_size=0, block_size=512, n_layer=16, n_head=6, n_embd=384, n_future=4),
                draft=GPTConfig(vocab_size=0, block_size=512, n_layer=2, n_head=4, n_embd=256, n_future=0),
                # expected_steps: one H200, bf16, issue 35's run
                target_train=TrainConfig(max_iters=20_000, max_seconds=140, batch_size=32, lr=1e-3, min_lr=1e-4,
                                         warmup_iters=200, eval_interval=500, expected_steps=5100),
                heads_train=TrainConfig(max_iters=2000, max_seconds=20, batch_size=32, lr=1e-3, min_lr=1e-4,
                                        warmup_iters=20, weight_decay=0.0, eval_interval=200),
                draft_train=TrainConfig(max_iters=20_000, max_seconds=25, batch_size=32, lr=2e-3, warmup_iters=100,
                                        eval_interval=1000),
                eagle_train=TrainConfig(max_iters=10_000, max_seconds=30, batch_size=32, lr=2e-3, warmup_iters=100,
                                        eval_interval=500),
                parallelspec_train=TrainConfig(max_iters=10_000, max_seconds=30, batch_size=32, lr=2e-3,
                                               warmup_iters=100, eval_interval=500),
                early_exit_train=TrainConfig(max_iters=5000, max_seconds=15, batch_size=32, lr=2e-3, warmup_iters=50,
                                             eval_interval=500)),
}
