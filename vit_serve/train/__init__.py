"""Training: the `Trainer` (loop.py) and its recipes (config.py: option defaults by mode and data set, model
presets; recipes.py: optimizers, schedules), data augmentation, evaluation, distributed and XLA glue, masked patch
prediction and few-shot evaluation."""
