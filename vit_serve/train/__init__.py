"""Training: the loop, recipes (optimizers, schedules), data augmentation, distributed and XLA glue,
masked patch prediction and few-shot evaluation."""
