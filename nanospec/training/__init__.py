"""Training, `make train`: the corpus (corpus.py) and the model sizes (presets.py), the training loop
(trainer.py, with the Muon optimizer in muon.py), the pipeline of stages train_tiny.py runs (pipeline.py), the MTP
heads' retraining on the target's own text (heads.py) and the drafters' losses and stages (drafter_losses.py,
drafters.py). Decoding never imports this folder."""
