"""Training: the `Trainer` and its recipes, data augmentation, evaluation, distributed and XLA glue, masked patch
prediction and few-shot evaluation.

- `loop`: the `Trainer` and `train(cfg)` (one CPU process, torchrun DDP, or XLA).
- `config`: `TrainConfig`, option defaults by mode and data set, model presets.
- `recipes`: the paper's optimisers and learning-rate schedules, layer-wise lr decay.
- `augment`: Inception crop, flip, RandAugment, Mixup / CutMix.
- `distill`: DeiT's distillation token and its loss.
- `ema`: an exponential moving average of the weights.
- `mpp`: masked patch prediction (the paper's self-supervised pre-training).
- `evaluate`, `fewshot`, `eval_checkpoint`: top-1 / top-5 and the confusion matrix; few-shot linear evaluation;
  `vit-serve eval`.
- `distributed`, `xla`: process groups and samplers; XLA / TPU glue.
- `seeded`, `state`: deterministic randomness across resumes; crash-safe training state.
- `progress`: the progress bar, metrics.jsonl and the curves.
"""
