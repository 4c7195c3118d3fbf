"""Compression: ADMM fine-tuning toward 2:4 sparse INT8 encoder weights, with distillation."""
